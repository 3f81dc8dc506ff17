"""The Pallas grouped matmul (interpret mode on CPU) against its dense one-hot jnp reference and against
jax.lax.ragged_dot: forward, dx and dw, with empty groups, groups of one row, boundaries inside a row tile, rows
past sum(group_sizes), a total past A; bf16 within bf16 tolerance; the tile schedule's coverage; and the kernels'
lowering to Triton IR for an H200 (no GPU needed)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (GmmTiles, TgmmTiles, gmm, grouped_matmul, grouped_matmul_reference,
                                           tgmm, tgmm_reference)
from pallas_kernels.grouped_matmul.schedule import make_schedule

# tiny tiles so that the shapes below span several tiles in every dimension
TILES = dict(tiles=GmmTiles(tm=16, tk=16, tn=32), tgmm_tiles=TgmmTiles(tm=16, ti=16, to=16))
A, I, O = 50, 32, 48  # A pads to 64 rows; O = 48 makes tn fall back to 16
SIZES = {
    "empty, one-row and straddling groups, trailing rows": [7, 0, 1, 19, 12],  # total 39 < A
    "first group empty, all rows used": [0, 16, 1, 1, 32],
    "total past A (cut at A)": [30, 0, 15, 10, 9],
}


def _case(sizes, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((A, I)), dtype)
    w = jnp.asarray(r.standard_normal((len(sizes), I, O)) / np.sqrt(I), dtype)
    dy = jnp.asarray(r.standard_normal((A, O)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


def _ragged(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST)


def _vjp(fn, x, w, gs, dy):
    y, pull = jax.vjp(lambda x, w: fn(x, w, gs), x, w)
    return (y, *pull(dy))


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_forward_and_grads_equal_reference_and_ragged_dot(sizes):
    x, w, gs, dy = _case(sizes)
    got = _vjp(lambda x, w, gs: grouped_matmul(x, w, gs, **TILES), x, w, gs, dy)
    ref = _vjp(grouped_matmul_reference, x, w, gs, dy)
    rag = _vjp(_ragged, x, w, gs, dy)
    for name, g, r, q in zip(("y", "dx", "dw"), got, ref, rag):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=2e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(g), np.asarray(q), atol=2e-5, rtol=2e-5, err_msg=name)
    total = min(sum(sizes), A)
    y, dx, dw = got
    assert np.all(np.asarray(y)[total:] == 0) and np.all(np.asarray(dx)[total:] == 0)  # rows past the groups
    for e, s in enumerate(sizes):
        if s == 0:
            assert np.all(np.asarray(dw)[e] == 0)  # an empty group's weight gradient


def test_tgmm_equals_reference_with_nan_outside_the_groups():
    """dw[e] reads only group e's rows: NaN in the rows past the groups must not reach dw."""
    x, _, gs, dy = _case([7, 0, 1, 19, 12])
    x = x.at[45:].set(jnp.nan)
    dy = dy.at[45:].set(jnp.nan)
    got = tgmm(x, dy, gs, tiles=TILES["tgmm_tiles"], interpret=True)
    ref = tgmm_reference(x[:39], dy[:39], gs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_bf16_within_bf16_tolerance_of_the_fp32_reference():
    x, w, gs, dy = _case([7, 0, 1, 19, 12], dtype=jnp.bfloat16, seed=1)
    got = _vjp(lambda x, w, gs: grouped_matmul(x, w, gs, **TILES), x, w, gs, dy)
    f32 = [a.astype(jnp.float32) for a in (x, w, dy)]
    ref = _vjp(grouped_matmul_reference, f32[0], f32[1], gs, f32[2])
    for name, g, r in zip(("y", "dx", "dw"), got, ref):
        assert g.dtype == jnp.bfloat16, name
        scale = float(np.abs(np.asarray(r)).max())
        np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(r), atol=1e-2 * scale,
                                   rtol=1e-2, err_msg=name)


def test_schedule_covers_every_row_exactly_once():
    """Each row of the padded rows is written by exactly one visit: its group's, or the zero tail's."""
    r = np.random.default_rng(2)
    tm, rows, e = 16, 128, 9
    for sizes in ([0] * 9, [128] + [0] * 8, list(r.multinomial(100, np.ones(e) / e)), [1] * 9, [3, 200] + [0] * 7):
        s = make_schedule(jnp.asarray(sizes, jnp.int32), rows, tm)
        group, tile, starts, ends = (np.asarray(a) for a in s)
        assert group.shape == (rows // tm + e,)
        covered = np.zeros(rows, int)
        for g, t in zip(group, tile):
            if g <= e:
                lo, hi = max(starts[g], t * tm), min(ends[g], (t + 1) * tm)
                assert hi > lo  # an active visit has rows to write
                covered[lo:hi] += 1
        assert np.all(covered == 1), sizes
        assert np.all(group[:-1] <= group[1:])  # visits in group order (w[e] reused by neighbours)


def test_bad_tile_is_an_error_naming_it():
    x, w, gs, _ = _case([7, 0, 1, 19, 12])
    with pytest.raises(ValueError, match="tile tk=24"):
        gmm(x, w, gs, tiles=GmmTiles(tm=16, tk=24, tn=16), interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, gs[:3])


H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                               platform="gpu"))
TRITON = "__gpu$xla.gpu.triton"


def test_kernels_lower_to_triton_for_an_h200():
    """gmm, its transposed form and tgmm at the default tiles go through the Pallas Triton lowering (power-of-2
    loads, dynamic group index, masked stores); Triton's own compilation only the GPU run checks."""
    a, d, f, e = 1024, 256, 128, 8
    x, dy = jnp.zeros((a, d), jnp.bfloat16), jnp.zeros((a, f), jnp.bfloat16)
    w, gs = jnp.zeros((e, d, f), jnp.bfloat16), jnp.zeros((e,), jnp.int32)
    fns = (lambda x, w, gs, dy: gmm(x, w, gs), lambda x, w, gs, dy: gmm(dy, w, gs, transpose_rhs=True),
           lambda x, w, gs, dy: tgmm(x, dy, gs))
    for fn in fns:
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(H200):
            warnings.simplefilter("ignore")  # the Pallas Triton backend's deprecation notice
            exp = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
                x, w, gs, dy)
        assert TRITON in exp.mlir_module()
