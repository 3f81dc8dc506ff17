"""Vision towers of the Qwen vision-language families (transformers 5.17's Qwen3VLVisionModel / Qwen3_5VisionModel).

- config.py: `VisionConfig`, the checkpoint's vision_config read (or refused) key by key;
- grid.py: host-side tables computed from `grid_thw` (rotary positions, learned-position interpolation taps,
  per-frame attention segments, the attention layout: whole frames packed into rows): data-dependent shapes stay
  out of the traced model;
- block.py: one pre-norm block (LayerNorm, attention with the 2-D rotary on the layout's rows, never the
  [heads, N, N] matrix of all patches; GELU MLP);
- merger.py: the patch merger (merge_size**2 neighbouring patches -> one language-model token);
- tower.py: `VisionTower`, patch embedding + learned positions + blocks + merger + deepstack mergers;
- hf_weights.py: the tower's parameters from and to transformers' tensor names (`model.visual.*`);
- mrope.py: the language model's multimodal rotary positions (get_rope_index) and cos / sin;
- inputs.py: `prepare_images`, the host side of a batch with images -> `ImageInputs` (jit-friendly, patches padded
  to a bucket) and per-segment `rope_positions` [3, B, T].

The decoder (models/decoder.py) holds the tower as `Decoder.visual` and takes `images=` / `rope_positions=`: the
merged embeddings replace the image placeholder tokens' embeddings and the deepstack features are added to those
tokens' hidden states after the first decoder layers (the layer scan's `after_layer` hook).
"""
