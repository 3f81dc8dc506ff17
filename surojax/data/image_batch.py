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

`split_image_batch(batch, parts, image_token_id=, merge_size=)` cuts a collated batch into `parts` micro-batches of
B / parts rows each (gradient accumulation), every array with a leading [parts] axis: the [B, T] fields
[parts, B / parts, T], rope_positions [parts, 3, B / parts, T], and each part's own images re-padded to one
common bucket, pixel_values [parts, P_pad, D] / image_grid_thw [parts, I_pad, 3]. Which row an image belongs to is
read from the tokens (a row holds t * h * w / merge_size**2 image tokens per image, its images in order).
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


def images_per_row(batch: dict[str, np.ndarray], *, image_token_id: int, merge_size: int) -> list[int]:
    """How many of the batch's images (in order) each row holds, from its image tokens."""
    tokens = np.asarray(batch["tokens"])
    real = np.asarray(batch["segment_ids"]) > 0 if "segment_ids" in batch else np.ones(tokens.shape, bool)
    need = ((tokens == image_token_id) & real).sum(axis=1)
    _, grids = unpad_images(batch)
    per_image = np.prod(grids, axis=1) // (merge_size * merge_size)
    counts, k = [], 0
    for r, n in enumerate(need):
        start = k
        while n > 0 and k < len(per_image):
            n -= per_image[k]
            k += 1
        if n != 0:
            raise ValueError(f"split_image_batch: row {r}'s {int(need[r])} image tokens do not match the grids of "
                             f"images {start}..{k - 1}")
        counts.append(k - start)
    if k != len(per_image):
        raise ValueError(f"split_image_batch: {len(per_image)} images but the rows' tokens hold {k}")
    return counts


def split_image_batch(batch: dict[str, np.ndarray], parts: int, *, image_token_id: int,
                      merge_size: int) -> dict[str, np.ndarray]:
    """A collated batch as `parts` micro-batches, each array with a leading [parts] axis (module docstring)."""
    B = len(batch["tokens"])
    if parts < 1 or B % parts:
        raise ValueError(f"split_image_batch: {B} rows do not split into {parts} equal micro-batches")
    size = B // parts
    out = {k: v.reshape(parts, size, *v.shape[1:]) for k, v in batch.items()
           if k not in IMAGE_KEYS and k != ROPE_KEY}
    if ROPE_KEY in batch:
        out[ROPE_KEY] = np.stack(np.split(batch[ROPE_KEY], parts, axis=1))
    if not all(k in batch for k in IMAGE_KEYS):
        return out
    pixels, grids = unpad_images(batch)
    counts = np.asarray(images_per_row(batch, image_token_id=image_token_id, merge_size=merge_size))
    image_ends = np.cumsum(counts.reshape(parts, size).sum(axis=1))
    patch_ends = np.r_[0, np.cumsum(np.prod(grids, axis=1))][np.r_[0, image_ends]]
    image_starts = np.r_[0, image_ends[:-1]]
    p_pad = max(patch_bucket(int(b - a), merge_size) for a, b in zip(patch_ends[:-1], patch_ends[1:]))
    i_pad = max(image_bucket(int(b - a)) for a, b in zip(image_starts, image_ends))
    out["pixel_values"] = np.zeros((parts, p_pad, pixels.shape[1]), np.float32)
    out["image_grid_thw"] = np.zeros((parts, i_pad, 3), np.int64)
    for j in range(parts):
        a, b = patch_ends[j], patch_ends[j + 1]
        out["pixel_values"][j, :b - a] = pixels[a:b]
        out["image_grid_thw"][j, :image_ends[j] - image_starts[j]] = grids[image_starts[j]:image_ends[j]]
    return out


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
