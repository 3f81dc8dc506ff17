"""The kernel layout is a lossless re-layout: decoding it equals the format's own dequantize bit for bit
(eagerly; under jit XLA may fuse NF4 double-quant's absmax decode code * scale + offset into one FMA)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layout import dequantize_layout, e2m1, layout_error, lookup16, to_layout
from surojax.quant.nf4 import NF4_CODE
from surojax.quant.nvfp4 import E2M1_VALUES
from kernel_weights import KERNEL_FORMATS, make_weight


@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_layout_decodes_bit_exactly(name):
    w = make_weight(name, 256, 48)
    for kt in (128, 256):
        lw = to_layout(w, kt)  # eager, as dequantize below: a jit fusion may contract NF4-dq's absmax decode
        got, want = np.asarray(dequantize_layout(lw)), np.asarray(w.dequantize(jnp.float32))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_lookup16_and_e2m1_are_the_tables():
    codes = jnp.arange(16, dtype=jnp.uint8)
    for got, table in ((lookup16(codes, NF4_CODE), NF4_CODE), (lookup16(codes, E2M1_VALUES), E2M1_VALUES),
                       (e2m1(codes), E2M1_VALUES)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), table.astype(np.float32).view(np.uint32))


def test_layout_errors_name_the_problem():
    w = make_weight("fp8", 192, 32)                  # K = 192: not a multiple of the 128-row K tile
    assert "K=192" in layout_error(w, 128)
    with pytest.raises(ValueError, match="K=192"):
        to_layout(w, 128)
    assert "multiple of the block" in layout_error(make_weight("nf4", 256, 32), 64)  # 4-bit halves need 2 x 64
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), make_weight("q8_0", 128, 32))
    assert "stacked" in layout_error(stacked, 128)
    q4_0 = __import__("surojax.quant", fromlist=["quantize"]).quantize(np.ones((64, 32), np.float32), "q4_0")
    assert "no fused kernel" in layout_error(q4_0, 128)
