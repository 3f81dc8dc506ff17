"""The vision tower's attention per frame on grid.py's [R, L] layout (block.frame_attention): equal to the dense
masked attention over all patches, a batch of frames of different sizes equal to each frame alone, every patch in
exactly one row with its whole frame, the cuDNN route's layout and mask (through
jax.nn.dot_product_attention's xla kernel on CPU), the memory plan's bound on the layout, and compiled memory that grows with
the patch count, not its square (the dense form's does: the check can tell them apart)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.vision.block import frame_attention
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.counts import attention_rows_bound
from surojax.models.vision.grid import frame_layout, layout_bucket, layout_shape, vision_grid
from surojax.models.vision.tower import VisionTower

HEADS, HD = 2, 8


def _dense(q, k, v, segment_ids, scale):
    """The former form: one [heads, N, N] matrix masked by frame."""
    scores = jnp.einsum("qhd,khd->hqk", q, k) * scale
    scores = jnp.where((segment_ids[:, None] == segment_ids[None, :])[None], scores, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)


def _qkv(n, seed=0):
    return [jnp.asarray(x) for x in np.random.default_rng(seed).standard_normal((3, n, HEADS, HD), np.float32)]


def test_layout_holds_whole_frames_once_within_the_plans_bound():
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(1, 200, rng.integers(1, 12)) * 4
        layout = frame_layout(sizes)
        assert layout.shape == layout_shape(sizes)
        starts = np.r_[0, np.cumsum(sizes)]
        assert sorted(layout[layout >= 0].tolist()) == list(range(starts[-1]))  # every patch exactly once
        frame_of = np.searchsorted(starts, np.arange(starts[-1]), side="right") - 1
        for row in layout:  # a frame's patches all in one row, in order
            held = row[row >= 0]
            for f in np.unique(frame_of[held]):
                assert held[frame_of[held] == f].tolist() == list(range(starts[f], starts[f + 1]))
        R, L = attention_rows_bound(int(sizes.sum()), int(sizes.max()))
        assert layout.shape[0] <= R and layout.shape[1] == L


def test_frame_attention_equals_the_dense_masked_form():
    sizes = [24, 4, 4, 32, 64, 8]  # rows share several frames (FFD: 64 | 32 + 24 + 8 | ...)
    segment_ids = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes), jnp.int32)
    q, k, v = _qkv(sum(sizes))
    layout = frame_layout(sizes)
    assert layout.shape[0] < len(sizes)
    dense = np.asarray(_dense(q, k, v, segment_ids, HD ** -0.5))
    out = frame_attention(q, k, v, segment_ids, jnp.asarray(layout), HD ** -0.5)
    np.testing.assert_allclose(np.asarray(out), dense, rtol=0, atol=1e-6)
    # the GPU route's arguments (layout rows and segment mask) through jax.nn.dot_product_attention's xla kernel
    via_api = frame_attention(q, k, v, segment_ids, jnp.asarray(layout), HD ** -0.5, implementation="xla")
    np.testing.assert_allclose(np.asarray(via_api), dense, rtol=0, atol=1e-5)


def test_frames_of_different_sizes_equal_each_frame_alone():
    v = VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, out_hidden_size=16,
                     num_position_embeddings=16, deepstack_visual_indexes=())
    graphdef, state = nnx.split(VisionTower(v, rngs=nnx.Rngs(0)))
    grids = np.array([[1, 4, 6], [2, 2, 2], [1, 8, 4]])  # a 2-frame clip among images of other sizes
    counts = np.prod(grids, axis=1)
    pixels = np.random.default_rng(1).standard_normal((int(counts.sum()), v.patch_dim), np.float32)

    def run(x, g):
        grid = vision_grid(g, v.spatial_merge_size, v.position_grid_side)
        return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, grid).last_hidden)(state, x))

    together = run(pixels, grids)
    starts = np.r_[0, np.cumsum(counts)]
    for i, g in enumerate(grids):
        alone = run(pixels[starts[i]:starts[i + 1]], g[None])
        np.testing.assert_allclose(together[starts[i]:starts[i + 1]], alone, rtol=0, atol=1e-5)


def _temp_bytes(attention, frames: int, frame: int) -> int:
    n = frames * frame
    segment_ids = np.repeat(np.arange(frames), frame).astype(np.int32)
    layout = frame_layout([frame] * frames)
    spec = jax.ShapeDtypeStruct((n, HEADS, HD), jnp.float32)
    fn = jax.jit(lambda q, k, v: attention(q, k, v, jnp.asarray(segment_ids), jnp.asarray(layout)))
    return fn.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def test_compiled_memory_grows_with_the_patches_not_their_square():
    """Frames of 64 patches, 16 then 64 of them (1,024 then 4,096 patches): the layout's temporaries grow about 3x
    (linear: measured 2.6x), the dense [heads, N, N] form's 8x or more (measured 8x: XLA keeps one fewer copy); no [heads, N, N] array in the compiled program."""
    def layout_form(q, k, v, seg, layout):
        return frame_attention(q, k, v, seg, layout, HD ** -0.5)

    def dense_form(q, k, v, seg, layout):
        return _dense(q, k, v, seg, HD ** -0.5)

    small, large = _temp_bytes(layout_form, 16, 64), _temp_bytes(layout_form, 64, 64)
    dense_small, dense_large = _temp_bytes(dense_form, 16, 64), _temp_bytes(dense_form, 64, 64)
    assert large / small < 5 and dense_large / dense_small > 6, (small, large, dense_small, dense_large)
    assert large < dense_large / 8
    n = 64 * 64
    spec = jax.ShapeDtypeStruct((n, HEADS, HD), jnp.float32)
    seg, layout = jnp.asarray(np.repeat(np.arange(64), 64), jnp.int32), jnp.asarray(frame_layout([64] * 64))
    hlo = jax.jit(lambda q, k, v: layout_form(q, k, v, seg, layout)).lower(spec, spec, spec).compile().as_text()
    assert f"{n},{n}]" not in hlo


def test_layout_bucket_two_shapes_per_octave():
    assert [layout_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 1025, 1537)] == \
        [1, 2, 3, 4, 6, 6, 8, 12, 12, 16, 1536, 2048]
