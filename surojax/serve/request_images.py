"""A served request's images on the engine side: prefix-cache keys, M-RoPE positions, and the vision tower's input
for each prefill chunk (the device side of serving a vision-language model; serve/image_prompt.py builds the
request's `ImagePrompt` on the host).

Design (chunked prefill): the vision tower runs INSIDE the prefill call of every chunk that holds some of an
image's tokens, over that whole image, and only the merged rows of the tokens in the chunk are scattered into
it (`ImageInputs.token_index`: the others are dropped). An image whose tokens lie in one chunk (the common case:
the default chunk is the token budget) is encoded once; one split over k chunks (or resumed after a prefix-cache
hit inside it, or recomputed after a preemption) is encoded k times. No tower output is kept between steps, so
chunking, preemption and prefix hits need nothing more than the token positions.

Positions: the prompt's tokens take the ImagePrompt's M-RoPE positions [3, L]; every later token (generated, or
recomputed after a preemption) at index i takes i + rope_delta on all three axes (transformers' Qwen3-VL decode:
cache_position + rope_deltas). The 1-D positions (index i) still address the KV cache and the attention mask.
Rows without images in a call that has some take their 1-D positions on all three axes (the same rotation as the
1-D rope); a call without image rows passes no M-RoPE positions at all (the text fast path).

Prefix cache: a block's key mixes in the content hash (sha256 of the decoded pixels) of every image whose tokens
it holds (`block_key`), so two prompts with the same ids and other pixels never share a block, and the same
picture sent as a file or as a data URL does; the chained hash carries it to every later block.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from surojax.models.vision.grid import vision_grid
from surojax.models.vision.inputs import ImageInputs, VisionTokens


@dataclass(frozen=True)
class RequestImages:
    """One request's images (from an `ImagePrompt`): pixel rows in prompt order, grids, token spans, hashes,
    the prompt's M-RoPE positions and the decode delta."""

    pixel_values: np.ndarray            # [P, patch_dim] float32
    image_grid_thw: np.ndarray          # [n, 3] int64
    image_spans: tuple[tuple[int, int], ...]  # (first token, token count) per image
    image_hashes: tuple[str, ...]
    rope_positions: np.ndarray          # [3, prompt length] int32
    rope_delta: int

    @classmethod
    def from_prompt(cls, prompt, prompt_len: int) -> "RequestImages":
        """From an `image_prompt.ImagePrompt` (or anything with its fields) whose ids are the request's prompt."""
        rope = np.asarray(prompt.rope_positions, np.int32)
        grids = np.asarray(prompt.image_grid_thw, np.int64).reshape(-1, 3)
        spans = tuple((int(a), int(b)) for a, b in prompt.image_spans)
        if rope.shape != (3, prompt_len):
            raise ValueError(f"images: rope_positions {list(rope.shape)} for a prompt of {prompt_len} tokens "
                             f"(expected [3, {prompt_len}])")
        if not (len(spans) == len(grids) == len(prompt.image_hashes)):
            raise ValueError(f"images: {len(spans)} spans, {len(grids)} grids and {len(prompt.image_hashes)} hashes "
                             "(one of each per image)")
        if any(a < 0 or a + b > prompt_len for a, b in spans):
            raise ValueError(f"images: image spans {spans} outside the prompt of {prompt_len} tokens")
        pixels = np.asarray(prompt.pixel_values, np.float32)
        if pixels.shape[0] != int(np.prod(grids, axis=1).sum()):
            raise ValueError(f"images: {pixels.shape[0]} pixel rows for grids {grids.tolist()}")
        return cls(pixels, grids, spans, tuple(prompt.image_hashes), rope, int(prompt.rope_delta))

    @property
    def patch_offsets(self) -> np.ndarray:
        """[n + 1] first pixel row of each image (and the total)."""
        return np.r_[0, np.cumsum(np.prod(self.image_grid_thw, axis=1))].astype(np.int64)

    def block_key(self, first: int, stop: int) -> tuple[str, ...]:
        """The hashes of the images with tokens in [first, stop) (empty: the block holds none)."""
        return tuple(h for (a, n), h in zip(self.image_spans, self.image_hashes) if a < stop and first < a + n)

    def rope_rows(self, start: int, n: int) -> np.ndarray:
        """[3, n] M-RoPE positions of tokens start .. start + n - 1 (module docstring)."""
        idx = np.arange(start, start + n)
        L = self.rope_positions.shape[1]
        out = np.broadcast_to(idx + self.rope_delta, (3, n)).astype(np.int32)
        inside = idx < L
        out[:, inside] = self.rope_positions[:, idx[inside]]
        return out


def request_images(s) -> RequestImages | None:
    """A scheduled request's images (None: a text request)."""
    req = getattr(s, "request", None)
    return getattr(req, "images", None) if req is not None else None


def group_rope_positions(group, R: int, T: int, positions: np.ndarray) -> np.ndarray | None:
    """M-RoPE positions [3, R, T] of a step call (positions [R, T] the 1-D ones); None when no row has images."""
    rows = [(r, im) for r, s in enumerate(group) if (im := request_images(s)) is not None]
    if not rows:
        return None
    out = np.broadcast_to(positions[None], (3, R, T)).astype(np.int32)
    for r, im in rows:
        s = group[r]
        out[:, r, :s.num_new_tokens] = im.rope_rows(s.start, s.num_new_tokens)
    return out


def group_rope_delta(group, R: int) -> np.ndarray | None:
    """[R] decode deltas of a multi-step call (rows without images 0); None when no row has images."""
    if all(request_images(s) is None for s in group):
        return None
    out = np.zeros(R, np.int32)
    for r, s in enumerate(group):
        im = request_images(s)
        out[r] = 0 if im is None else im.rope_delta
    return out


def _patch_bucket(n: int, block: int) -> int:
    """The smallest block * 2^k >= n: few compiled shapes for the tower."""
    k = -(-max(n, 1) // block)
    return block * (1 << (k - 1).bit_length())


def chunk_images(group, R: int, T: int, tokens: VisionTokens) -> ImageInputs | None:
    """The tower's input for a step call (rows r = group[r], each computing tokens start .. start +
    num_new_tokens - 1): every image with tokens in a row's chunk, whole, and the flat index r * T + t of each
    of its merged rows that lands in the chunk (R * T: dropped). None when no chunk holds an image token."""
    v = tokens.vision
    m = v.spatial_merge_size
    pixels, grids, index = [], [], []
    for r, s in enumerate(group):
        im = request_images(s)
        if im is None:
            continue
        lo, hi = s.start, s.start + s.num_new_tokens
        offsets = im.patch_offsets
        for k, (first, count) in enumerate(im.image_spans):
            if not (first < hi and lo < first + count):
                continue
            pixels.append(im.pixel_values[offsets[k]:offsets[k + 1]])
            grids.append(im.image_grid_thw[k])
            pos = first + np.arange(count)
            index.append(np.where((pos >= lo) & (pos < hi), r * T + pos - lo, R * T))
    if not grids:
        return None
    real = sum(p.shape[0] for p in pixels)
    size = _patch_bucket(real, m * m)
    pad = size - real
    grid = vision_grid(np.stack(grids), m, v.position_grid_side)

    def padded(x, fill=0):
        return np.concatenate([x, np.full((pad, *x.shape[1:]), fill, x.dtype)])

    token_index = np.concatenate(index).astype(np.int32)
    token_index = np.concatenate([token_index, np.full(size // (m * m) - token_index.size, R * T, np.int32)])
    return ImageInputs(pixel_values=padded(np.concatenate(pixels).astype(np.float32)),
                       rotary_positions=padded(grid.rotary_positions), interp_indices=padded(grid.interp_indices),
                       interp_weights=padded(grid.interp_weights),
                       patch_segments=padded(grid.segment_ids, int(grid.segment_ids.max()) + 1),
                       token_index=token_index, attention_layout=grid.attention_layout)


__all__ = ["RequestImages", "chunk_images", "group_rope_delta", "group_rope_positions",
           "request_images"]
