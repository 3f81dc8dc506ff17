"""K-quant and IQ4 quantisers: bytes equal to llama.cpp's own quantiser (golden bytes from ggml_quantize_chunk,
made by scripts/make_gguf_fixtures.py), the error of dequantise(quantise(w)) within each type's bound, and the hook
into surojax.quant.quantize / the formats."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from surojax.quant import FORMATS, quantize
from surojax.quant import quantize_iq4, quantize_kquants
from surojax.quant.quantize_kquants import nearest_int

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gguf" / "kquants.npz"
IMPL = {**{t: quantize_kquants for t in quantize_kquants.BLOCK_QUANTIZERS},
        **{t: quantize_iq4 for t in quantize_iq4.BLOCK_QUANTIZERS}}
TYPES = sorted(IMPL)


def quantize_rows(x, name):
    return IMPL[name].quantize_rows(x, name)


@pytest.fixture(scope="module")
def golden():
    return np.load(FIXTURE)


@pytest.mark.parametrize("name", TYPES)
def test_bytes_equal_llama_cpp(golden, name):
    x = golden["x"]
    got = quantize_rows(x, name)
    ref = golden[name]
    assert got.shape == ref.shape and got.dtype == np.uint8
    bad = np.where(~(got == ref).all(axis=1))[0]
    assert bad.size == 0, f"{name}: rows {bad.tolist()} differ from llama.cpp"


def test_nearest_int_is_ggml_rounding():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.49999, -7.7, 4194303.0], np.float32)
    np.testing.assert_array_equal(nearest_int(v), [0, 2, 2, 0, -2, 3, -8, 4194303])


# |w - dequantize(quantize(w))| <= C * (256-value super-block absmax) on Gaussian rows; C well above what the
# types reach (measured: Q2_K 0.37, Q3_K 0.20, Q4_K 0.08, Q5_K 0.045, Q6_K 0.022, IQ4_NL 0.073, IQ4_XS 0.083 of
# the absmax) and far below what a wrong byte layout gives (~1).
ROUND_TRIP_C = {"q2_k": 0.5, "q3_k": 0.3, "q4_k": 0.13, "q5_k": 0.065, "q6_k": 0.03, "iq4_nl": 0.11, "iq4_xs": 0.12}


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_error_bound(name):
    rng = np.random.default_rng(3)
    k, n = 512, 24
    w = rng.normal(size=(k, n)).astype(np.float32)
    f = quantize(w, name)
    assert isinstance(f, FORMATS[name]) and f.shape == (k, n)
    deq = np.asarray(f.dequantize(jnp.float32))
    amax = np.abs(w.T.reshape(n, -1, 256)).max(-1, keepdims=True)
    err = np.abs(deq.T - w.T).reshape(n, -1, 256)
    assert np.all(err <= ROUND_TRIP_C[name] * amax), (name, float((err / amax).max()))
    # the format's bytes are the row quantiser's bytes of w.T
    np.testing.assert_array_equal(np.asarray(f.data), quantize_rows(w.T, name))


def test_rows_must_be_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((128, 4), np.float32), "q4_k")
