"""`surojax bench train --images SIDE`: the synthetic image rows of a vision-language shape.

Each row of the bench's packed batch [A, B, T] gets one SIDE x SIDE image opening its first sequence:
<|vision_start|>, (SIDE / patch)^2 / merge^2 image tokens, <|vision_end|>, then the row's random text; the image
tokens (and the start token before them) are not predicted, the random patch rows are the image's pixels. The
rows are collated as the Trainer's loader collates image rows (data/image_batch.py), so train/image_inputs.py's
`step_image_batch` makes the step's micro-batches exactly as in `surojax sft`.
"""
from __future__ import annotations

import numpy as np

from surojax.bench.shapes import shape_hf_config
from surojax.data.image_batch import collate_image_rows
from surojax.models.vision.inputs import VisionTokens


def image_tokens(shape: str, side: int) -> int:
    """Language-model tokens of one side x side image of a vision-language shape."""
    vision = shape_hf_config(shape)["vision_config"]
    return (side // vision["patch_size"]) ** 2 // vision["spatial_merge_size"] ** 2


def synthetic_image_rows(rng: np.random.Generator, host_batch: dict[str, np.ndarray], tokens: VisionTokens,
                         side: int, vision_end_token_id: int) -> dict[str, np.ndarray]:
    """The packed batch [A, B, T] with one side x side image opening each row's first sequence -> the collated
    host batch the Trainer's loader gives (rows [A * B, T], pixel_values, image_grid_thw; data/image_batch.py)."""
    v = tokens.vision
    grid = side // v.patch_size
    n = grid * grid // v.spatial_merge_size ** 2
    flat = {k: x.reshape(-1, x.shape[-1]).copy() for k, x in host_batch.items()}
    ids = flat["tokens"]
    ids[(ids == tokens.image_token_id) | (ids == tokens.video_token_id) | (ids == tokens.vision_start_token_id)] = 1
    ids[:, 0], ids[:, 1:1 + n], ids[:, 1 + n] = tokens.vision_start_token_id, tokens.image_token_id, \
        vision_end_token_id
    seg = flat["segment_ids"]
    nxt = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
    flat["targets"] = np.where(np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros_like(seg[:, :1], bool)], 1),
                               nxt, 0).astype(np.int32)
    flat["loss_mask"][:, :1 + n] = 0.0  # the image tokens (and the start token before them) are not predicted
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    rows = [{**{k: x[r] for k, x in flat.items()},
             "pixel_values": rng.standard_normal((grid * grid, patch_dim), dtype=np.float32),
             "image_grid_thw": np.array([[1, grid, grid]], np.int64)} for r in range(len(ids))]
    return collate_image_rows(rows, v.spatial_merge_size)
