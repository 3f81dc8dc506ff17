"""What the vision tower costs, from its `VisionConfig` alone: parameters, forward FLOPs per patch, and activation
bytes, for the memory plan (offload/memory_plan.py) and the step's FLOP count (train/adaptive.py, bench MFU).

Parameters (the modules of tower.py / block.py / merger.py; checked against a loaded tower in tests):
    patch embedding   patch_dim x H + H
    learned positions num_position_embeddings x H
    each block        2 LayerNorms (4H), qkv (3H^2 + 3H), proj (H^2 + H), fc1 (HI + I), fc2 (IH + H)
    each merger       LayerNorm (2H, or 2Hm^2 post-shuffle: the deepstack mergers), fc1 (Hm^2 x Hm^2 + Hm^2),
                      fc2 (Hm^2 x out + out); the merger + one per deepstack index
FLOPs per patch (forward, matmuls: 2 per multiply-add): 2 x (the blocks' and mergers' weight parameters per patch:
each merger's per merged row / m^2) plus the attention 4 x frame x H per block (scores and values over the patch's
frame of `frame` patches). The training step's backward pass adds 2x where the tower trains, nothing where frozen
(no gradient flows into it: only the merged rows' scatter).
"""
from __future__ import annotations

from surojax.models.vision.config import VisionConfig
from surojax.models.vision.grid import layout_bucket


def _merger_params(v: VisionConfig, postshuffle: bool) -> int:
    joined = v.hidden_size * v.spatial_merge_size ** 2
    norm = 2 * (joined if postshuffle else v.hidden_size)
    return norm + joined * joined + joined + joined * v.out_hidden_size + v.out_hidden_size


def tower_lora_params(v: VisionConfig, rank: int) -> int:
    """Parameters of rank-`rank` LoRA adapters on every Linear of the blocks and mergers (surojax.peft.vision_lora):
    r x (in + out) each."""
    H, I, joined = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    block = (H + 3 * H) + (H + H) + (H + I) + (I + H)
    merger = (joined + joined) + (joined + v.out_hidden_size)
    return rank * (v.depth * block + (1 + len(v.deepstack_visual_indexes)) * merger)


def block_params(v: VisionConfig) -> int:
    H, I = v.hidden_size, v.intermediate_size
    return 4 * H + 3 * H * H + 3 * H + H * H + H + H * I + I + I * H + H


def tower_params(v: VisionConfig) -> int:
    """Parameters of the tower with its mergers (module docstring)."""
    H = v.hidden_size
    embed = v.patch_dim * H + H + v.num_position_embeddings * H
    mergers = _merger_params(v, False) + len(v.deepstack_visual_indexes) * _merger_params(v, True)
    return embed + v.depth * block_params(v) + mergers


def tower_flops_per_patch(v: VisionConfig, frame_patches: int) -> float:
    """Forward FLOPs of one patch in a frame of `frame_patches` patches (module docstring)."""
    H, I, m2 = v.hidden_size, v.intermediate_size, v.spatial_merge_size ** 2
    joined = H * m2
    matmul = v.patch_dim * H + v.depth * (4 * H * H + 2 * H * I)
    merger = (joined * joined + joined * v.out_hidden_size) / m2
    mergers = (1 + len(v.deepstack_visual_indexes)) * merger
    return 2.0 * (matmul + mergers) + v.depth * 4.0 * frame_patches * H


def attention_rows_bound(patches: int, frame_patches: int = 0) -> tuple[int, int]:
    """The largest attention layout (R, L) grid.py's `frame_layout` builds for `patches` patches in frames of at
    most `frame_patches` (0: unknown, one frame of all of them): L = the frame's `layout_bucket`; one row when L
    holds every patch, else at most floor((2 * patches - 1) / L) + 1 (first fit leaves at most one row half empty),
    bucketed the same way."""
    patches = max(int(patches), 1)
    frame = min(int(frame_patches), patches) if frame_patches else patches
    length = layout_bucket(frame)
    rows = 1 if length >= patches else (2 * patches - 1) // length + 1
    return layout_bucket(rows), length


def tower_activation_bytes(v: VisionConfig, patches: int, *, c: int, trains: bool, frame_patches: int = 0) -> int:
    """Device bytes of the tower's activations for `patches` patches of a micro-batch, in frames of at most
    `frame_patches` (0: unknown, one frame), in the compute dtype (c bytes). Attention runs on the [R, L] layout
    (attention_rows_bound): its scores, softmax (fp32) and probabilities are [heads, R, L, L], O(patches x frame),
    plus q, k, v and the output gathered into R x L slots. Frozen: nothing is kept for the backward pass, so the
    peak is one block's working set (its input, qkv, that attention, the MLP's I-wide hidden) plus the merged rows
    and deepstack features the decoder reads. Trained: every block keeps its inputs (about 8H + 2I values a patch)
    and its attention probabilities and gathered q, k, v for the backward pass, besides that working set."""
    H, I = v.hidden_size, v.intermediate_size
    R, L = attention_rows_bound(patches, frame_patches)
    outputs = (1 + len(v.deepstack_visual_indexes)) * patches // v.spatial_merge_size ** 2 * v.out_hidden_size * c
    scores = v.num_heads * R * L * L
    attention = scores * (4 + 4 + c) + 4 * R * L * H * c  # scores, softmax, probabilities; q, k, v, out in slots
    working = patches * (5 * H + 2 * I) * c + attention
    if not trains:
        return int(working + outputs)
    kept = v.depth * (patches * (8 * H + 2 * I) * c + scores * c + 3 * R * L * H * c)
    return int(kept + working + outputs)
