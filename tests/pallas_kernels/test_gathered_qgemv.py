"""The gathered quantised GEMV (pallas_kernels/gathered_gemv/quant_kernel.py, interpret mode on CPU) against its
reference (reference.py: the layout decoded, then the row-by-row product) and against the format's own
`dequantize` of the routed experts: every fused-kernel format family (4-bit codes with offsets, byte codes, a
code book), both bodies, K split or not, an expert routed twice, a layer of a stack read at its base."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gathered_gemv import QuantGatheredTiles, gathered_quant_gemv
from pallas_kernels.gathered_gemv.reference import gathered_layout_ref
from surojax.quant.random_weights import random_weight
from tests.tolerances import reorder_atol

K, N, E, L = 256, 64, 4, 2


def _stack(fmt, seed=0):
    """A random [L, E] stack in `fmt` and its layout with arrays [L E, ...]."""
    w = random_weight(fmt, K, N, jax.random.key(seed), (L, E))
    lw = jax.vmap(jax.vmap(lambda v: v.kernel_layout(128)))(w)
    flat = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])  # noqa: E731
    return w, dataclasses.replace(lw, codes=flat(lw.codes), scale=flat(lw.scale), offset=flat(lw.offset))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "nf4"])
@pytest.mark.parametrize("body,splits", [("fma", 1), ("fma", 2), ("dot", 0)])
def test_kernel_equals_the_reference_and_the_formats_own_values(fmt, body, splits):
    w, stack = _stack(fmt)
    x = jax.random.normal(jax.random.key(1), (5, K), jnp.float32)
    ids = jnp.asarray([3, 0, 3, 1, 2], jnp.int32)  # expert 3 routed twice
    layer = 1
    y = gathered_quant_gemv(x, stack, ids, num_experts=E, base=layer * E, interpret=True,
                            tiles=QuantGatheredTiles(bn=32, splits=splits, body=body))
    assert y.shape == (5, N) and y.dtype == x.dtype
    ref = np.asarray(gathered_layout_ref(x, stack, ids, layer * E))
    own = np.asarray(w.dequantize(jnp.float32))[layer][np.asarray(ids)]  # [A, K, N]: the format's own decoding
    truth = np.einsum("ak,akn->an", np.asarray(x, np.float64), own.astype(np.float64))
    terms = np.abs(np.asarray(x, np.float64))[:, :, None] * np.abs(own)
    atol = reorder_atol(K, np.float32, terms.sum(axis=1).max())
    np.testing.assert_allclose(ref, truth, rtol=0, atol=atol)  # the layout decodes as the format does
    np.testing.assert_allclose(np.asarray(y), truth, rtol=0, atol=atol)


def test_bf16_rows_round_like_the_reference():
    _, stack = _stack("q4_k", seed=2)
    x = jax.random.normal(jax.random.key(3), (3, K), jnp.float32).astype(jnp.bfloat16)
    ids = jnp.asarray([1, 1, 0], jnp.int32)
    y = gathered_quant_gemv(x, stack, ids, num_experts=E, interpret=True, tiles=QuantGatheredTiles(bn=64))
    ref = gathered_layout_ref(x, stack, ids)
    assert y.dtype == jnp.bfloat16
    unit = float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.abs(ref.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=0, atol=unit)
    # mode xla is the reference itself
    np.testing.assert_array_equal(np.asarray(gathered_quant_gemv(x, stack, ids, num_experts=E, mode="xla")),
                                  np.asarray(ref))


def test_bad_operands_are_named():
    _, stack = _stack("q4_k")
    x = jnp.zeros((2, K), jnp.float32)
    with pytest.raises(ValueError, match="expert_ids"):
        gathered_quant_gemv(x, stack, jnp.zeros((3,), jnp.int32), num_experts=E, interpret=True)
    with pytest.raises(ValueError, match=r"x \(2, 128\)"):
        gathered_quant_gemv(x[:, :128], stack, jnp.zeros((2,), jnp.int32), num_experts=E, interpret=True)
    with pytest.raises(ValueError, match="splits=3"):
        gathered_quant_gemv(x, stack, jnp.zeros((2,), jnp.int32), num_experts=E, interpret=True,
                            tiles=QuantGatheredTiles(splits=3))
    with pytest.raises(ValueError, match="body"):
        gathered_quant_gemv(x, stack, jnp.zeros((2,), jnp.int32), num_experts=E, interpret=True,
                            tiles=QuantGatheredTiles(body="wmma"))


def test_lowers_to_triton_for_an_h200():
    """Both bodies, split and not, lower through Pallas' Triton lowering at Qwen3-30B-A3B's gate_up shape (the
    offline sm_90 compile: benchmarks/triton_offline_check.py dump-gathered)."""
    from tests.pallas_kernels.test_triton_lowering import TRITON, _lower
    from pallas_kernels.gathered_gemv.quant_kernel import gathered_quant_kernel

    w = random_weight("q4_k", 2048, 1536, jax.random.key(0), (2,))
    lw = jax.vmap(lambda v: v.kernel_layout(128))(w)
    x, ids = jnp.zeros((8, 2048), jnp.bfloat16), jnp.zeros((8,), jnp.int32)
    for tiles in (QuantGatheredTiles(), QuantGatheredTiles(bn=128, splits=1, body="dot", num_warps=8)):
        fn = lambda x, lw, ids, base: gathered_quant_kernel(x, lw, ids, base, num_experts=2, tiles=tiles)  # noqa: E731
        assert TRITON in _lower(fn, x, lw, ids, jnp.zeros((1,), jnp.int32))
