"""The kernel layout is a lossless re-layout: decoding it equals the format's own dequantize bit for bit
(eagerly; under jit XLA may fuse NF4 double-quant's absmax decode code * scale + offset into one FMA)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_weights import KERNEL_FORMATS, make_weight
from pallas_kernels.quant_matmul.layout import LayoutSpec, Table16, decode_integer, e2m1, lookup16, to_layout
from pallas_kernels.quant_matmul.reference import dequantize_layout
from surojax.quant import quantize
from surojax.quant.nf4 import NF4_CODE
from surojax.quant.nvfp4 import E2M1_VALUES


@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_layout_decodes_bit_exactly(name):
    w = make_weight(name, 256, 48)
    for kt in (128, 256):
        lw = w.kernel_layout(kt)  # eager, as dequantize below: a jit fusion may contract NF4-dq's absmax decode
        got, want = np.asarray(dequantize_layout(lw)), np.asarray(w.dequantize(jnp.float32))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_lookup16_table16_and_e2m1_are_the_tables():
    codes = jnp.arange(16, dtype=jnp.uint8)
    for got, table in ((lookup16(codes, NF4_CODE), NF4_CODE), (Table16.of(NF4_CODE)(codes), NF4_CODE),
                       (lookup16(codes, E2M1_VALUES), E2M1_VALUES), (e2m1(codes), E2M1_VALUES)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), table.astype(np.float32).view(np.uint32))


def test_to_layout_packs_the_halves_of_each_k_tile():
    """Value k of a 4-bit column sits in byte row (k // kt) * kt/2 + k % (kt/2), low nibble for the first half."""
    spec = LayoutSpec("t", nibble=True, group=16, has_offset=False, decode=decode_integer)
    k, n, kt = 64, 16, 32
    codes = (jnp.arange(n * k, dtype=jnp.int32).reshape(n, k) % 16).astype(jnp.uint8)        # [N, K]
    lw = to_layout(spec, codes, jnp.ones((n, k // 16)), None, kt)
    assert lw.codes.shape == (k // 2, n) and lw.shape == (k, n)
    kk = np.arange(k)
    row = (kk // kt) * (kt // 2) + kk % (kt // 2)
    high = (kk % kt) >= kt // 2
    got = np.where(high[:, None], np.asarray(lw.codes)[row] >> 4, np.asarray(lw.codes)[row] & 0x0F)
    np.testing.assert_array_equal(got, np.asarray(codes).T)
    with pytest.raises(ValueError, match="do not fit"):
        to_layout(spec, codes, jnp.ones((n, k // 32)), None, kt)


def test_layout_errors_name_the_problem():
    w = make_weight("fp8", 192, 32)                  # K = 192: not a multiple of the 128-row K tile
    assert "K=192" in w.kernel_layout_error(128)
    with pytest.raises(ValueError, match="K=192"):
        w.kernel_layout(128)
    assert "multiple of the block" in make_weight("nf4", 256, 32).kernel_layout_error(64)  # 4-bit halves: 2 x 64
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), make_weight("q8_0", 128, 32))
    assert "stacked" in stacked.kernel_layout_error(128)
    q4_0 = quantize(np.ones((64, 32), np.float32), "q4_0")
    assert "no fused kernel" in q4_0.kernel_layout_error(128)
