"""The decoder's image input: host-side preparation of everything data-dependent, and the jit-friendly result.

A batch of token rows [B, T] (packed or not) with its images -> `ImageBatch`:
- `images: ImageInputs`, arrays whose shapes depend only on the patch bucket and the attention layout: the pixel
  rows [Pb, patch_dim] (every row's images in row order, then zero rows), the tower's per-patch tables (grid.py:
  2-D rotary positions, learned-position taps, attention segments: one per frame, the padding patches one of their
  own), the attention layout [R, L] (grid.py's `frame_layout`: the frames packed into rows; no row holds a padding
  patch) and `token_index` [Pb / m^2]: the flat index b * T + t of the image token each merged tower row replaces
  (the merged rows come in image order, and so do the image tokens in flat order: transformers' masked_scatter),
  B * T for the padding rows (dropped by the scatter). A training loop compiles once per patch bucket
  (`patch_bucket`) and layout shape (grid.py's `layout_bucket`: R from the packing, L from the largest frame).
- `rope_positions [3, B, T]`: M-RoPE positions (mrope.py's get_rope_index) per segment: each segment of a packed row
  (segment ids 1..k, 0 = padding) is placed as transformers places it alone (positions restart at 0; its images are
  the next grids in order); padding tokens take position 0. A text-only segment's three rows are 0..n-1, the 1-D
  positions, so the text path is unchanged.

Checked before any device work, each a named error: image tokens without pixels (or pixels without image tokens),
a run of image tokens that does not hold its grid's merged token count, a pixel_values row count that is not the
grids' patch count, video tokens (not supported yet), a row layout that is not [B, T].

The images are the `image_token_id` runs only; the ids come from the checkpoint's outer config.json
(`VisionTokens.from_config`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from surojax.models.config import ModelConfig
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.grid import VisionGrid, vision_grid
from surojax.models.vision.mrope import mrope_positions


class ImageInputError(ValueError):
    """Images and token rows that do not fit each other; the message names the row / image."""


@dataclass(frozen=True)
class VisionTokens:
    """The placeholder token ids of a vision-language checkpoint and its tower's shape."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision: VisionConfig

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "VisionTokens":
        """From the outer config.json (kept in `cfg.hf_extra`) of a family with a vision tower."""
        hf = cfg.hf_extra
        missing = [k for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_config")
                   if k not in hf]
        if missing:
            raise ImageInputError(f"{cfg.model_type}: config.json lacks {missing} (a vision-language checkpoint's "
                                  "outer config names its image token ids and vision_config)")
        return cls(int(hf["image_token_id"]), int(hf["video_token_id"]), int(hf["vision_start_token_id"]),
                   VisionConfig.from_hf(hf["vision_config"], cfg.model_type))


class ImageInputs(NamedTuple):
    """The decoder's image input (a pytree of arrays; module docstring). Pb = the patch bucket, m = merge size."""

    pixel_values: jax.Array      # [Pb, patch_dim]
    rotary_positions: jax.Array  # [Pb, 2] int32
    interp_indices: jax.Array    # [Pb, 4] int32
    interp_weights: jax.Array    # [Pb, 4] float32
    patch_segments: jax.Array    # [Pb] int32
    token_index: jax.Array       # [Pb / m^2] int32, B * T = padding
    attention_layout: jax.Array  # [R, L] int32 patch indices, -1 = empty slot

    def grid(self) -> VisionGrid:
        """The tower's tables (grid_thw is not needed in the traced model: an empty placeholder)."""
        return VisionGrid(grid_thw=np.zeros((0, 3), np.int64), rotary_positions=self.rotary_positions,
                          interp_indices=self.interp_indices, interp_weights=self.interp_weights,
                          segment_ids=self.patch_segments, attention_layout=self.attention_layout)


class ImageBatch(NamedTuple):
    images: ImageInputs | None  # None: no image in the batch
    rope_positions: np.ndarray  # [3, B, T] int32
    # [B] int32: each row's last segment's max position + 1 - its length; a token generated after it at index i of
    # that segment gets position i + delta on all three axes (mrope.mrope_decode_positions)
    rope_deltas: np.ndarray


def bucket(n: int, step: int) -> int:
    """The smallest multiple of `step` >= n (at least `step`)."""
    return max(step, -(-n // step) * step)


def _real_grids(grid, row: str) -> np.ndarray:
    g = np.zeros((0, 3), np.int64) if grid is None else np.asarray(grid)
    if g.size == 0:
        return np.zeros((0, 3), np.int64)
    if g.ndim != 2 or g.shape[1] != 3:
        raise ImageInputError(f"{row}: image_grid_thw must be [n, 3], got shape {g.shape}")
    g = g.astype(np.int64)
    zero = (g == 0).all(axis=1)
    if (~zero[np.argmax(zero):]).any() and zero.any():
        raise ImageInputError(f"{row}: image_grid_thw has a real grid after a zero (padding) row: {g.tolist()}")
    return g[~zero]


def _real_pixels(pixels, n: int, patch_dim: int, row: str) -> np.ndarray:
    p = np.zeros((0, patch_dim), np.float32) if pixels is None else np.asarray(pixels)
    if p.size == 0:
        p = np.zeros((0, patch_dim), np.float32)
    if p.ndim != 2 or p.shape[1] != patch_dim:
        raise ImageInputError(f"{row}: pixel_values must be [patches, {patch_dim}] (channels x temporal_patch_size "
                              f"x patch_size^2), got shape {p.shape}")
    if p.shape[0] < n or (p.shape[0] > n and np.any(p[n:])):
        raise ImageInputError(f"{row}: pixel_values has {p.shape[0]} rows, image_grid_thw's grids need {n} patches "
                              "(extra rows are allowed only as zero padding)")
    return p[:n]


def _image_runs(row: np.ndarray, image_token_id: int) -> int:
    return int(np.sum(np.diff(np.r_[0, (row == image_token_id).astype(int)]) == 1))


def _split_rows(tokens: VisionTokens, ids: np.ndarray, pixel_values, image_grid_thw) -> tuple[list, list]:
    """transformers' layout (the batch's images in row order: pixel_values [P, patch_dim], image_grid_thw [n, 3])
    -> one entry per row, by the rows' runs of image tokens."""
    grids = _real_grids(image_grid_thw, "image_grid_thw")
    runs = [_image_runs(row, tokens.image_token_id) for row in ids]
    if sum(runs) != len(grids):
        raise ImageInputError(f"image_grid_thw has {len(grids)} images but input_ids hold {sum(runs)} runs of image "
                              f"tokens ({tokens.image_token_id}) (per row: {runs})")
    patches = np.prod(grids, axis=1) if len(grids) else np.zeros((0,), np.int64)
    pixels = _real_pixels(pixel_values, int(patches.sum()), tokens.vision.patch_dim, "batch")
    cut_grids = np.cumsum([0, *runs])
    cut_pixels = np.r_[0, np.cumsum(patches)][cut_grids]
    return ([pixels[cut_pixels[b]:cut_pixels[b + 1]] for b in range(len(ids))],
            [grids[cut_grids[b]:cut_grids[b + 1]] for b in range(len(ids))])


def prepare_images(tokens: VisionTokens | ModelConfig, input_ids, pixel_values, image_grid_thw, *, segment_ids=None,
                   patch_bucket: int | None = None) -> ImageBatch:
    """input_ids [B, T]; pixel_values / image_grid_thw either one entry per row (a list: that row's images in
    order, [P_r, patch_dim] / [n_r, 3]) or transformers' layout (arrays [P, patch_dim] / [n, 3]: the batch's images
    in row order), zero grid rows and trailing zero pixel rows being padding; None for a batch without images.
    segment_ids [B, T] (1..k, 0 = padding; None: one segment per row, no padding); patch_bucket: pad the patch count
    to a multiple of it (None: the merge block m^2, no padding beyond). `tokens`: the checkpoint's VisionTokens or
    its ModelConfig -> ImageBatch."""
    if isinstance(tokens, ModelConfig):
        tokens = VisionTokens.from_config(tokens)
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ImageInputError(f"input_ids: expected [batch, seq], got shape {ids.shape}")
    B, T = ids.shape
    if pixel_values is not None and not isinstance(pixel_values, (list, tuple)):
        pixel_values, image_grid_thw = _split_rows(tokens, ids, pixel_values, image_grid_thw)
    seg = np.ones_like(ids, np.int32) if segment_ids is None else np.asarray(segment_ids)
    if seg.shape != ids.shape:
        raise ImageInputError(f"segment_ids: shape {seg.shape} differs from input_ids {ids.shape}")
    v = tokens.vision
    m = v.spatial_merge_size
    for name, rows in (("pixel_values", pixel_values), ("image_grid_thw", image_grid_thw)):
        if rows is not None and len(rows) != B:
            raise ImageInputError(f"{name}: one entry per row expected, got {len(rows)} for {B} rows")
    grids = [_real_grids(None if image_grid_thw is None else image_grid_thw[b], f"row {b}") for b in range(B)]
    if (ids == tokens.video_token_id).any():
        b = int(np.argwhere(ids == tokens.video_token_id)[0][0])
        raise ImageInputError(f"row {b}: video tokens ({tokens.video_token_id}) are not supported yet")
    positions = np.zeros((3, B, T), np.int32)
    deltas = np.zeros((B,), np.int32)
    pixels, tables, index = [], [], []
    for b in range(B):
        row, g = ids[b], grids[b]
        n_image_tokens = int((row == tokens.image_token_id).sum())
        n_patches = int(np.prod(g, axis=1).sum()) if len(g) else 0
        if n_image_tokens and pixel_values is None:
            raise ImageInputError(f"row {b}: {n_image_tokens} image tokens ({tokens.image_token_id}) but no "
                                  "pixel_values / image_grid_thw")
        pixels.append(_real_pixels(None if pixel_values is None else pixel_values[b], n_patches, v.patch_dim,
                                   f"row {b}"))
        used = 0
        for s in np.unique(seg[b]):
            if s == 0:
                continue
            where = np.flatnonzero(seg[b] == s)
            if np.any(np.diff(where) != 1):
                raise ImageInputError(f"row {b}: segment {int(s)} is not one contiguous run of tokens")
            runs = _image_runs(row[where], tokens.image_token_id)
            try:
                pos, delta = mrope_positions(row[where][None], g[used:used + runs], image_token_id=tokens.image_token_id,
                                         video_token_id=tokens.video_token_id,
                                         vision_start_token_id=tokens.vision_start_token_id, spatial_merge_size=m)
            except ValueError as e:
                raise ImageInputError(f"row {b}, segment {int(s)} (tokens {int(where[0])}..{int(where[-1])}): "
                                      f"{e}") from None
            positions[:, b, where] = pos[:, 0]
            deltas[b] = delta[0]
            used += runs
        if used != len(g):
            raise ImageInputError(f"row {b}: image_grid_thw has {len(g)} images but the row's segments hold {used} "
                                  "runs of image tokens")
        tables += [gg for gg in g]
        index.append(b * T + np.flatnonzero(row == tokens.image_token_id))
    if not tables:
        return ImageBatch(None, positions, deltas)
    real = sum(p.shape[0] for p in pixels)
    size = bucket(real, m * m if patch_bucket is None else patch_bucket)
    if size % (m * m):
        raise ImageInputError(f"patch_bucket {patch_bucket} must be a multiple of the merge block {m * m}")
    grid = vision_grid(np.stack(tables), m, v.position_grid_side)
    pad = size - real

    def padded(x, fill=0):
        return np.concatenate([x, np.full((pad, *x.shape[1:]), fill, x.dtype)])

    token_index = np.concatenate(index).astype(np.int32)
    token_index = np.concatenate([token_index, np.full(size // (m * m) - token_index.size, B * T, np.int32)])
    images = ImageInputs(
        pixel_values=padded(np.concatenate(pixels).astype(np.float32)),
        rotary_positions=padded(grid.rotary_positions), interp_indices=padded(grid.interp_indices),
        interp_weights=padded(grid.interp_weights),
        patch_segments=padded(grid.segment_ids, int(grid.segment_ids.max()) + 1),
        token_index=token_index, attention_layout=grid.attention_layout)
    return ImageBatch(images, positions, deltas)
