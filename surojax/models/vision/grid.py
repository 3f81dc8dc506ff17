"""Host-side tables from `grid_thw`, the tower's data-dependent inputs (transformers 5.17's vision_utils.py).

Patches arrive in merge-block order (the image processor's layout): within a frame, blocks of merge x merge patches
row-major over the block grid, and row-major inside a block. For each patch this computes
- `rotary_positions` [N, 2]: its (row, col) in the frame's patch grid (`get_vision_position_ids`; repeated per
  frame of a clip);
- `interp_indices` / `interp_weights` [N, 4]: the bilinear taps (align_corners=True, border clamp) that resample the
  learned side x side position table to the frame's h x w grid (`get_vision_interpolation_indices_and_weights`,
  mode "bilinear"); weights computed in float32 as torch computes them;
- `segment_ids` [N]: which frame it belongs to; attention stays within a frame (`get_vision_cu_seqlens` with
  merge_temporal False: each frame of each image or video is its own segment);
- `attention_layout` [R, L]: where attention runs (`frame_layout`). Attention stays within a frame, so the tower
  never builds the [heads, N, N] matrix of all patches: the frames are packed first-fit-decreasing into R rows of L
  slots (L = the largest frame's patch count, R = the rows used, each rounded up by `layout_bucket` to the next of
  1, 2, 3, 4, 6, 8, 12, ...: two shapes per octave, so few compiles and at most 1.5x padding on each axis; each
  entry a patch index, -1 an empty slot), and block.py attends inside each row with the frames' segment mask:
  [heads, R, L, L] scores. First fit leaves at most one row half empty, so R * L < 1.5 * (2N + L) and the scores are
  O(N * L), not O(N^2); a frame never straddles two rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionGrid:
    grid_thw: np.ndarray          # [n, 3] int64
    rotary_positions: np.ndarray  # [N, 2] int32
    interp_indices: np.ndarray    # [N, 4] int32
    interp_weights: np.ndarray    # [N, 4] float32
    segment_ids: np.ndarray       # [N] int32
    attention_layout: np.ndarray  # [R, L] int32 patch indices, -1 = empty slot

    @property
    def num_patches(self) -> int:
        return int(self.segment_ids.shape[0])


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped to the table) and weights, align_corners=True, in float32."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, 0).astype(np.float32)


def layout_bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (2^k and 3 x 2^k) >= n: the layout's R and L."""
    power = 1 << max(int(n) - 1, 0).bit_length()
    return 3 * power // 4 if power >= 4 and 3 * power // 4 >= n else power


def layout_shape(frame_sizes) -> tuple[int, int]:
    """(R, L) of `frame_layout` for frames of these patch counts (the packing's row count, from the same packing)."""
    return _pack(np.asarray(frame_sizes, np.int64))[1:]


def _pack(sizes: np.ndarray) -> tuple[list[list[int]], int, int]:
    """First-fit decreasing of frames (sizes) into rows of L = layout_bucket(largest) slots -> (frames per row, R,
    L)."""
    length = layout_bucket(int(sizes.max())) if sizes.size else 1
    rows, free = [], []
    for f in sorted(range(sizes.size), key=lambda i: (-sizes[i], i)):
        fit = next((r for r, room in enumerate(free) if room >= sizes[f]), None)
        if fit is None:
            rows.append([])
            free.append(length)
            fit = len(rows) - 1
        rows[fit].append(f)
        free[fit] -= int(sizes[f])
    return rows, layout_bucket(max(len(rows), 1)), length


def frame_layout(frame_sizes) -> np.ndarray:
    """The attention layout [R, L] int32 for consecutive frames of `frame_sizes` patches (module docstring): each
    row holds whole frames' patch indices, -1 in the empty slots."""
    sizes = np.asarray(frame_sizes, np.int64)
    packed, R, L = _pack(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    layout = np.full((R, L), -1, np.int32)
    for r, frames in enumerate(packed):
        patches = np.concatenate([np.arange(starts[f], starts[f + 1]) for f in sorted(frames)])
        layout[r, :patches.size] = patches
    return layout


def pad_layout(layout: np.ndarray, rows: int, length: int) -> np.ndarray:
    """`layout` [R, L] grown to [rows, length] with empty slots (-1): micro-batches that share one shape."""
    out = np.full((rows, length), -1, np.int32)
    out[:layout.shape[0], :layout.shape[1]] = layout
    return out


def vision_grid(grid_thw, merge_size: int, position_grid_side: int) -> VisionGrid:
    """The tables for images / clips of `grid_thw` [n, 3] (t, h, w in patches; h and w multiples of merge_size)."""
    grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    if (grid_thw < 1).any() or (grid_thw[:, 1:] % merge_size).any():
        raise ValueError(f"grid_thw {grid_thw.tolist()}: every t, h, w must be positive and h, w multiples of "
                         f"the merge size {merge_size}")
    rows, cols, heights, widths, segments, frames = [], [], [], [], [], []
    segment = 0
    for t, h, w in grid_thw.tolist():
        within = np.arange(h * w)
        blocks_w = w // merge_size
        in_col = within % merge_size
        in_row = (within // merge_size) % merge_size
        block = within // (merge_size * merge_size)
        row = (block // blocks_w) * merge_size + in_row
        col = (block % blocks_w) * merge_size + in_col
        rows.append(np.tile(row, t))
        cols.append(np.tile(col, t))
        heights.append(np.full(t * h * w, h))
        widths.append(np.full(t * h * w, w))
        segments.append(np.repeat(np.arange(segment, segment + t), h * w))
        frames += [h * w] * t
        segment += t
    row, col = np.concatenate(rows), np.concatenate(cols)
    h_taps, h_weights = _axis_taps(row, np.concatenate(heights), position_grid_side)
    w_taps, w_weights = _axis_taps(col, np.concatenate(widths), position_grid_side)
    indices = (h_taps[:, :, None] * position_grid_side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return VisionGrid(grid_thw=grid_thw, rotary_positions=np.stack([row, col], -1).astype(np.int32),
                      interp_indices=indices.astype(np.int32), interp_weights=weights.astype(np.float32),
                      segment_ids=np.concatenate(segments).astype(np.int32), attention_layout=frame_layout(frames))
