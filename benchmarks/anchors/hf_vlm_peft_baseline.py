"""Anchor: transformers + PEFT LoRA training throughput on image + text rows (Qwen3-VL), one CUDA GPU.

Random-initialised weights with the real shapes; every row is one image (a side x side picture: (side / 16)^2
patches, a quarter of that as language-model tokens between <|vision_start|> and <|vision_end|>) followed by random
text up to --seq tokens, the image tokens unsupervised (labels -100). LoRA r16 on the language model's seven linears
(PEFT's regex over `model.language_model.layers`), the vision tower and merger frozen, as surojax trains by default.
Run it in the same GPU job as ours and report the ratio of tokens/s (every position of the rows counts).

    python3 benchmarks/anchors/hf_vlm_peft_baseline.py --shape qwen3-vl-2b --batch 8 --seq 2048 --side 448
    python3 benchmarks/anchors/hf_vlm_peft_baseline.py --shape debug-vl --device cpu --batch 2 --seq 64 --side 64
Prints one line: RESULT {json}.
"""
import argparse
import json
import time

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

# Qwen/Qwen3-VL-2B-Instruct's config.json (transformers 5 keys); debug-vl: a CPU-sized model of the same kind.
SHAPES = {
    "qwen3-vl-2b": dict(
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, tie_word_embeddings=True,
                         rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                           num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
                           hidden_act="gelu_pytorch_tanh"),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=True),
    "debug-vl": dict(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         tie_word_embeddings=True,
                         rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh"),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        tie_word_embeddings=True),
}
TARGETS = r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def image_rows(cfg, batch: int, seq: int, side: int, device):
    """(input_ids [B, seq], labels, pixel_values [B * patches, 3 * T * P * P], image_grid_thw [B, 3])."""
    v = cfg.vision_config
    grid = side // v.patch_size
    n_tokens = grid * grid // v.spatial_merge_size ** 2
    if n_tokens + 3 > seq:
        raise SystemExit(f"--side {side} gives {n_tokens} image tokens, more than --seq {seq} holds")
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, min(cfg.image_token_id, cfg.vision_start_token_id) - 1, (batch, seq), generator=g)
    ids = text.clone()
    ids[:, 0] = cfg.vision_start_token_id
    ids[:, 1:1 + n_tokens] = cfg.image_token_id
    ids[:, 1 + n_tokens] = cfg.vision_end_token_id
    labels = ids.clone()
    labels[:, :2 + n_tokens] = -100
    patch_dim = 3 * v.temporal_patch_size * v.patch_size ** 2
    pixels = torch.randn(batch * grid * grid, patch_dim, generator=g)
    grid_thw = torch.tensor([[1, grid, grid]] * batch)
    return ids.to(device), labels.to(device), pixels.to(device), grid_thw.to(device), n_tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-vl-2b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--side", type=int, default=448, help="image side in pixels (a multiple of 32)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()

    from peft import LoraConfig, get_peft_model

    cfg = Qwen3VLConfig(**SHAPES[a.shape])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    with torch.device(a.device):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, target_modules=TARGETS))
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=a.device == "cuda")
    ids, labels, pixels, grid_thw, n_tokens = image_rows(cfg, a.batch, a.seq, a.side, a.device)
    pixels = pixels.to(dtype)
    mm_types = (ids == cfg.image_token_id).long()  # the processor's mm_token_type_ids: 1 on image tokens

    def step():
        loss = model(input_ids=ids, labels=labels, pixel_values=pixels, image_grid_thw=grid_thw,
                     mm_token_type_ids=mm_types).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    loss_first = float(step())
    for _ in range(2):
        step()
    sync()
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t) / a.steps
    print("RESULT " + json.dumps({
        "impl": "hf-transformers+peft", "shape": a.shape, "mode": "lora", "batch": a.batch, "seq": a.seq,
        "side": a.side, "image_tokens_per_row": n_tokens, "tokens_per_s": a.batch * a.seq / dt, "step_ms": dt * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None,
        "loss": float(loss), "loss_first": loss_first, "torch": torch.__version__,
        "trainable": sum(q.numel() for q in params)}))


if __name__ == "__main__":
    main()
