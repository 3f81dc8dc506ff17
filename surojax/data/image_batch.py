"""Batching rows that carry images: ragged pixel_values concatenated and padded to buckets, M-RoPE positions stacked.

A packed image row (image_rows.ImagePackedRows) holds the [T] fields of the batch contract (batch.py) plus
    pixel_values    [P, D] float32  its images' patches, in segment order (P varies by row, 0 without images)
    image_grid_thw  [n, 3] int64    one (t, h, w) per image, same order (n varies by row)
    rope_positions  [3, T] int32    M-RoPE (t, h, w) positions, restarting per segment; 0 on padding
`collate_image_rows(rows, merge_size)` makes the batch:
    the [T] fields  [B, T]          stacked as for text rows
    pixel_values    [P_pad, D]      every row's patches concatenated in row order, then zero rows up to P_pad
    image_grid_thw  [I_pad, 3]      every row's grids in row order, then (0, 0, 0) rows up to I_pad
    rope_positions  [3, B, T]       transformers' layout (`get_rope_index` returns position_ids [3, B, T])
with P_pad = merge_size**2 * (the next power of two >= P / merge_size**2) and I_pad the next power of two >= I (the
compiled shapes take few values), and P_pad = I_pad = 0 for a batch without images. The real patches are the first
sum(t * h * w) rows of pixel_values; a grid row with t == 0 is padding. `unpad_images` takes the padding off again.

A batch of rows without image keys (a text model's) is stacked unchanged (`stack_rows`, grain's default batching).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
ROPE_KEY = "rope_positions"


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def patch_bucket(patches: int, merge_size: int) -> int:
    """Rows pixel_values is padded to: 0 for 0, else merge_size**2 times a power of two, >= patches."""
    if patches == 0:
        return 0
    group = merge_size * merge_size
    return group * next_power_of_two(-(-patches // group))


def image_bucket(images: int) -> int:
    """Rows image_grid_thw is padded to: 0 for 0, else the next power of two >= images."""
    return 0 if images == 0 else next_power_of_two(images)


def stack_rows(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows of equal-shape arrays -> [B, ...] arrays (what grain's default batch does)."""
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def collate_image_rows(rows: Sequence[dict[str, np.ndarray]], merge_size: int) -> dict[str, np.ndarray]:
    """Rows (dicts as ImagePackedRows gives them) -> one batch; see the module docstring."""
    if not rows:
        raise ValueError("collate_image_rows: no rows")
    if not all(k in rows[0] for k in IMAGE_KEYS):
        return stack_rows(rows)
    fixed = {k: np.stack([r[k] for r in rows]) for k in rows[0] if k not in IMAGE_KEYS and k != ROPE_KEY}
    pixels = np.concatenate([np.asarray(r["pixel_values"], np.float32) for r in rows])
    grids = np.concatenate([np.asarray(r["image_grid_thw"], np.int64).reshape(-1, 3) for r in rows])
    if int(np.prod(grids, axis=1).sum()) != len(pixels):
        raise ValueError(f"collate_image_rows: the rows' grids cover {int(np.prod(grids, axis=1).sum())} patches "
                         f"but their pixel_values hold {len(pixels)}")
    p_pad, i_pad = patch_bucket(len(pixels), merge_size), image_bucket(len(grids))
    fixed["pixel_values"] = np.concatenate([pixels, np.zeros((p_pad - len(pixels), pixels.shape[1]), np.float32)])
    fixed["image_grid_thw"] = np.concatenate([grids, np.zeros((i_pad - len(grids), 3), np.int64)])
    if ROPE_KEY in rows[0]:
        fixed[ROPE_KEY] = np.stack([r[ROPE_KEY] for r in rows], axis=1).astype(np.int32)  # [3, B, T]
    return fixed


def unpad_images(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [sum of patches, D], image_grid_thw [n, 3]) of a collated batch without its padding."""
    grids = batch["image_grid_thw"]
    grids = grids[grids[:, 0] > 0]
    return batch["pixel_values"][:int(np.prod(grids, axis=1).sum())], grids


def empty_image_row(seq_len: int, width: int, *, rope: bool) -> dict[str, np.ndarray]:
    """The image keys of a padding row (no images; rope positions 0), for the eval loader's last batch."""
    row = {"pixel_values": np.zeros((0, width), np.float32), "image_grid_thw": np.zeros((0, 3), np.int64)}
    if rope:
        row[ROPE_KEY] = np.zeros((3, seq_len), np.int32)
    return row
