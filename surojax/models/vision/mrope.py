"""Multimodal rotary positions (M-RoPE) of Qwen3-VL / Qwen3.5 (and Qwen2-VL's chunked layout), as pure functions.

Positions (host side, numpy; transformers 5.17's `Qwen3VLModel.get_rope_index`, which `Qwen3_5Model` repeats
unchanged): each token gets three positions (t, h, w) -> `positions [3, B, T]`. Over a row's real tokens
(attention_mask 1; padding keeps position 0 on every axis, as transformers leaves it), a run of text gets
consecutive positions on all three axes; a run of image tokens (one image: grid (t, h, w) of patches, merged
`spatial_merge_size` x `spatial_merge_size` into t * h/m * w/m tokens, row-major) gets
t-axis = current + frame, h-axis = current + row, w-axis = current + col, after which `current` advances by
max(h, w) / m (not by the run's length). A video of grid (t, h, w) is split into t one-frame grids, as Qwen3-VL's
processor separates the frames with timestamp text: each frame is its own run, placed like an image.
`rope_deltas [B]` = max position + 1 - number of real tokens: a token generated after the prompt at real index i
(counting the prompt's real tokens from 0) gets position i + delta on all three axes (`mrope_decode_positions`).

Runs are found as transformers finds them (maximal runs of image / video token ids; the grids are consumed in
order, images and videos separately); a run must follow the vision-start token and hold exactly its grid's token
count, else a named error (transformers would fail on a shape mismatch or place tokens silently wrong).

Cos/sin (jnp, fp32 then cast): inv_freq over the rotary dims (Qwen3.5: head_dim * partial_rotary_factor) as
transformers computes it in fp32; each frequency j takes its angle from one axis: chunked layout (Qwen2-VL /
Qwen2.5-VL) = the first section[0] frequencies from t, the next section[1] from h, the rest from w; interleaved
(Qwen3-VL [24, 20, 20], Qwen3.5 [11, 11, 10]) = t everywhere except j = 1, 4, 7, ... < 3*section[1] from h and
j = 2, 5, 8, ... < 3*section[2] from w. Then [cos, cos] / [sin, sin] over the rotary dims (rotate_half
convention), so the result feeds `layers.rope.apply_rope` as the 1-D rope's cos/sin do.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


def _grid_array(name: str, grid, merge: int) -> np.ndarray:
    if grid is None:
        return np.zeros((0, 3), np.int64)
    g = np.asarray(grid)
    if g.ndim != 2 or g.shape[1] != 3 or not np.issubdtype(g.dtype, np.integer):
        raise ValueError(f"{name}: expected an integer array [n, 3] of (t, h, w), got shape {g.shape} {g.dtype}")
    g = g.astype(np.int64)
    for i, (t, h, w) in enumerate(g):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"{name}[{i}] = {[int(t), int(h), int(w)]}: t, h, w must be positive and h, w "
                             f"multiples of spatial_merge_size {merge}")
    return g


def _vision_positions(start: int, t: int, h: int, w: int) -> np.ndarray:
    """[3, t*h*w] (t, h, w) positions of one merged grid placed at `start`, row-major (get_vision_position_ids)."""
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(input_ids, image_grid_thw, video_grid_thw=None, *, image_token_id: int, video_token_id: int,
                    vision_start_token_id: int, spatial_merge_size: int,
                    attention_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """input_ids [B, T] -> (positions [3, B, T] int32, rope_deltas [B] int32); see the module docstring."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids: expected [batch, seq], got shape {ids.shape}")
    m = int(spatial_merge_size)
    if m < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask: shape {mask.shape} differs from input_ids {ids.shape}")
    images = _grid_array("image_grid_thw", image_grid_thw, m)
    videos = _grid_array("video_grid_thw", video_grid_thw, m)
    frames = np.repeat(videos, videos[:, 0], axis=0)  # one grid per frame, as Qwen3-VL splits its videos
    frames[:, 0] = 1
    grids = {IMAGE: list(images), VIDEO: list(frames)}
    used = {IMAGE: 0, VIDEO: 0}
    names = {IMAGE: "image", VIDEO: "video frame"}

    B, T = ids.shape
    positions = np.zeros((3, B, T), np.int64)
    deltas = np.zeros((B,), np.int64)
    for b in range(B):
        row = ids[b][mask[b]]
        if row.size == 0:
            raise ValueError(f"input_ids row {b}: no real tokens (attention_mask is all 0)")
        kind = np.where(row == image_token_id, IMAGE, np.where(row == video_token_id, VIDEO, TEXT))
        cuts = np.flatnonzero(np.diff(kind)) + 1
        parts, current = [], 0
        for start, end in zip(np.r_[0, cuts], np.r_[cuts, row.size]):
            k, n = int(kind[start]), int(end - start)
            if k == TEXT:
                parts.append(np.broadcast_to(np.arange(n) + current, (3, n)))
                current += n
                continue
            if used[k] >= len(grids[k]):
                raise ValueError(f"input_ids row {b}, token {start}: a run of {names[k]} tokens but "
                                 f"{'image_grid_thw' if k == IMAGE else 'video_grid_thw'} has no grid left "
                                 f"({len(grids[k])} {names[k]}s in all)")
            if start == 0 or row[start - 1] != vision_start_token_id:
                raise ValueError(f"input_ids row {b}, token {start}: {names[k]} tokens not preceded by the vision "
                                 f"start token {vision_start_token_id}")
            t, h, w = (int(x) for x in grids[k][used[k]])
            h, w = h // m, w // m
            if n != t * h * w:
                raise ValueError(f"input_ids row {b}, token {start}: {n} {names[k]} tokens but {names[k]} "
                                 f"{used[k]} has grid {[t, h * m, w * m]} = {t * h * w} merged tokens")
            used[k] += 1
            parts.append(_vision_positions(current, t, h, w))
            current += max(h, w)
        row_pos = np.concatenate(parts, axis=1)
        positions[:, b, mask[b]] = row_pos
        deltas[b] = row_pos.max() + 1 - row.size
    for k in (IMAGE, VIDEO):
        if used[k] != len(grids[k]):
            raise ValueError(f"{'image_grid_thw' if k == IMAGE else 'video_grid_thw'}: {len(grids[k])} "
                             f"{names[k]}s but input_ids hold {used[k]} runs of {names[k]} tokens")
    return positions.astype(np.int32), deltas.astype(np.int32)


def mrope_decode_positions(real_index, rope_deltas) -> np.ndarray:
    """Positions [3, B, T] of tokens after the prompt: real_index [B, T] (the token's index among its row's real
    tokens, prompt included) + rope_deltas [B], the same on all three axes (transformers' generation)."""
    idx = np.asarray(real_index, np.int64)
    d = np.asarray(rope_deltas, np.int64).reshape(-1, 1)
    if idx.ndim != 2 or d.shape[0] != idx.shape[0]:
        raise ValueError(f"real_index [B, T] and rope_deltas [B] disagree: {idx.shape} vs {d.shape[0]}")
    return np.broadcast_to(idx + d, (3, *idx.shape)).astype(np.int32)


def mrope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """[rotary_dim / 2] fp32: 1 / theta ** (arange(0, dim, 2) / dim). transformers computes the power in torch's
    fp32 pow, which is not correctly rounded; the power in fp64 rounded to fp32, then an fp32 division, is the
    closest numpy gets (equal or 1 ulp off)."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    power = np.power(np.float64(theta), exponent.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) / power).astype(np.float32)


def mrope_axis_of_frequency(half: int, mrope_section: Sequence[int], interleaved: bool) -> np.ndarray:
    """[half] int: which axis (0 = t, 1 = h, 2 = w) each frequency takes its position from."""
    sec = [int(s) for s in mrope_section]
    if len(sec) != 3 or min(sec) < 0 or sum(sec) != half:
        raise ValueError(f"mrope_section {list(mrope_section)}: expected 3 non-negative sizes summing to "
                         f"rotary_dim / 2 = {half}")
    if not interleaved:
        return np.repeat(np.arange(3), sec)
    axis = np.zeros(half, np.int64)
    for a in (1, 2):
        axis[np.arange(a, min(3 * sec[a], half), 3)] = a
    return axis


def mrope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, mrope_section: Sequence[int],
                  interleaved: bool, dtype=jnp.float32,
                  inv_freq: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
    """positions [3, B, T] -> cos, sin [B, T, rotary_dim] (fp32 math, then cast to `dtype`). `inv_freq`
    [rotary_dim / 2] overrides `mrope_inv_freq(rotary_dim, theta)` (the decoder passes the one its 1-D rope uses,
    `layers.rope.inv_freq(cfg)`)."""
    if positions.ndim != 3 or positions.shape[0] != 3:
        raise ValueError(f"positions: expected [3, batch, seq], got shape {positions.shape}")
    inv = mrope_inv_freq(rotary_dim, theta) if inv_freq is None else np.asarray(inv_freq, np.float32)
    if inv.shape != (rotary_dim // 2,):
        raise ValueError(f"inv_freq: expected shape ({rotary_dim // 2},), got {inv.shape}")
    axis = mrope_axis_of_frequency(inv.shape[0], mrope_section, interleaved)
    pos = jnp.moveaxis(jnp.asarray(positions).astype(jnp.float32)[axis], 0, -1)  # [B, T, half]
    angles = pos * jnp.asarray(inv)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
