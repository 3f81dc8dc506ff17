"""NF4 / FP8-block / NVFP4: round-trip error bounds on random normal weights, exact reproduction of representable
weights, pytree + jit behaviour."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.quant_matmul.reference import dequantize_layout
from surojax.quant import FORMATS, NF4, NVFP4, FP8Block, quantize
from surojax.quant.nf4 import NF4_CODE, dynamic_map
from surojax.quant.nvfp4 import E2M1_VALUES

K, N = 256, 192


def _w(seed=0, k=K, n=N):
    return np.random.default_rng(seed).normal(size=(k, n)).astype(np.float32) * 0.05


def _deq(f):
    return np.asarray(f.dequantize(jnp.float32))


def test_nf4_code_and_dynamic_map():
    assert NF4_CODE.shape == (16,) and NF4_CODE[0] == -1 and NF4_CODE[7] == 0 and NF4_CODE[15] == 1
    assert np.all(np.diff(NF4_CODE) > 0)
    code = dynamic_map()
    assert code.shape == (256,) and code[-1] == 1.0 and 0.0 in code and np.all(np.diff(code) >= 0)


@pytest.mark.parametrize("dq", [False, True])
def test_nf4_round_trip_bound(dq):
    w = _w()
    f = NF4.quantize(w, double_quant=dq)
    assert f.data.dtype == jnp.uint8 and f.data.shape == (K * N // 2,)
    blocks = np.ascontiguousarray(w.T).reshape(-1, 64)
    amax = np.abs(blocks).max(-1, keepdims=True)
    err = np.abs(_deq(f).T.reshape(-1, 64) - blocks)
    # half the widest gap of the NF4 table (between -1 and -0.696): 0.1520 of the block absmax; with double
    # quantisation plus the absmax error: half a step (0.9/64 / 2) of the 256-block's max |absmax - mean|
    bound = 0.1520 * amax
    if dq:
        c = (amax[:, 0] - amax.mean())
        c = np.pad(c, (0, (-c.size) % 256)).reshape(-1, 256)
        bound = bound + np.repeat(np.abs(c).max(-1), 256)[:amax.size, None] * (0.9 / 64 / 2) * 1.01
    assert np.all(err <= bound + 1e-8)
    rel = np.sqrt((err ** 2).mean() / (blocks ** 2).mean())
    assert rel < 0.10, rel  # measured 0.092 for both
    assert f.nbytes == (K * N // 2 + K * N // 64 * 4 if not dq else K * N // 2 + K * N // 64 + 3 * 4 + 4 + 1024)


def test_nf4_high_nibble_first():
    w = np.zeros((64, 1), np.float32)
    w[0, 0], w[1, 0] = -1.0, 1.0  # first value -> code 0 (-1), second -> code 15 (+1)
    assert int(NF4.quantize(w).data[0]) == 0x0F


def test_nf4_exact_on_representable():
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 16, size=(K * N // 64, 64))
    idx[:, 0] = 15  # every block holds +1 x its scale, so the absmax is the scale
    scale = (2.0 ** rng.integers(-8, 0, size=(K * N // 64, 1))).astype(np.float32)
    wt = (NF4_CODE[idx] * scale).reshape(N, K)
    f = NF4.quantize(wt.T)
    np.testing.assert_array_equal(_deq(f), wt.T)
    # double quantisation is exact too when every absmax is the same (offset = absmax, residuals 0)
    wt = (NF4_CODE[idx] * np.float32(0.125)).reshape(N, K)
    np.testing.assert_array_equal(_deq(NF4.quantize(wt.T, double_quant=True)), wt.T)


def test_fp8_round_trip_bound():
    w = _w(1, 300, 200)  # not multiples of 128: partial edge blocks
    f = FP8Block.quantize(w)
    assert f.data.dtype == jnp.float8_e4m3fn and f.data.shape == (200, 300) and f.scale.shape == (2, 3)
    s = np.repeat(np.repeat(np.asarray(f.scale), 128, 0), 128, 1)[:200, :300].T
    err = np.abs(_deq(f) - w)
    assert np.all(err <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s)
    assert np.sqrt((err ** 2).mean() / (w ** 2).mean()) < 0.03  # measured 0.026


def test_fp8_exact_on_representable():
    rng = np.random.default_rng(4)
    q = rng.normal(size=(N, K)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 40
    q = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    q[::128, ::128] = 448.0  # each 128x128 block's absmax is 448 ...
    scale = (2.0 ** rng.integers(-10, -2, size=(N // 128 + 1, K // 128))).astype(np.float32)
    wt = q * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:N, :K]  # ... times a power of two
    f = FP8Block.quantize(wt.T)
    np.testing.assert_array_equal(np.asarray(f.scale), scale)
    np.testing.assert_array_equal(_deq(f), wt.T)


@pytest.mark.parametrize("block", [(1, 256), (64, 128), (1, 384), (32, 64)])
def test_fp8_other_scale_blocks_decode_and_lay_out_exactly(block):
    """A checkpoint's scale block (per channel (1, K), per tensor (N, K), groups, transformers' [bn, bk]): the value
    is code * its block's scale, and the kernel layout (one scale per 128 of a row) decodes to the same bits where
    bk is a multiple of 128; narrower blocks say why they have no kernel."""
    rng = np.random.default_rng(7)
    n, k = 96, 384
    bn, bk = block
    codes = rng.normal(size=(n, k)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.01, 1, size=(-(-n // bn), -(-k // bk))).astype(np.float32)
    f = FP8Block(data=jnp.asarray(codes), scale=jnp.asarray(scale), shape=(k, n), block=block)
    want = codes.astype(np.float32) * np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
    np.testing.assert_array_equal(_deq(f), want.T)
    if bk % 128:
        assert "scale blocks are 64 wide" in f.kernel_layout_error(128)
        return
    got = np.asarray(dequantize_layout(f.kernel_layout(128)))
    np.testing.assert_array_equal(got.view(np.uint32), want.T.view(np.uint32))


def test_nvfp4_round_trip_bound():
    w = _w(2)
    f = NVFP4.quantize(w)
    assert f.data.shape == (N, K // 2) and f.scale.shape == (N, K // 16) and f.scale.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(float(f.global_scale), np.abs(w).max() / (6 * 448), rtol=1e-7)
    assert float(jnp.asarray(f.scale).astype(jnp.float32).max()) == 448.0
    eff = np.repeat(np.asarray(f.scale).astype(np.float32) * float(f.global_scale), 16, 1).T
    err = np.abs(_deq(f) - w)
    assert np.all(err <= eff * (1 + 1e-6))
    assert np.sqrt((err ** 2).mean() / (w ** 2).mean()) < 0.11  # measured 0.095


def test_nvfp4_exact_on_representable_and_nibble_order():
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 16, size=(N, K // 16, 16))
    codes[..., 0] = 7  # +6 in every block: block absmax = 6 * scale
    scales = rng.normal(size=(N, K // 16)).astype(np.float32)
    scales = np.abs(scales * 64).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) + 1
    scales = scales.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales[0, 0] = 448.0  # the tensor absmax is 6 * 448 * g
    g = np.float32(2.0 ** -12)
    wt = (E2M1_VALUES[codes] * scales[..., None] * g).reshape(N, K)
    f = NVFP4.quantize(wt.T)
    assert float(f.global_scale) == g
    np.testing.assert_array_equal(_deq(f), wt.T)
    assert int(f.data[0, 0]) == (codes[0, 0, 0] | (codes[0, 0, 1] << 4))  # even element in the low nibble


@pytest.mark.parametrize("name,kw", [("nf4", {}), ("nf4", {"double_quant": True}), ("fp8", {}), ("nvfp4", {})])
def test_pytree_and_jit(name, kw):
    w = _w(6)
    f = quantize(w, name, **kw)
    assert isinstance(f, FORMATS[name])
    leaves, treedef = jax.tree.flatten(f)
    assert all(isinstance(x, jax.Array) for x in leaves)
    same = jax.tree.map(lambda x: x, f)
    assert type(same) is type(f) and same.shape == f.shape
    np.testing.assert_array_equal(_deq(same), _deq(f))
    x = jnp.asarray(np.random.default_rng(7).normal(size=(3, K)), jnp.float32)
    y = jax.jit(lambda x, f: f.matmul(x))(x, f)
    np.testing.assert_allclose(y, x @ _deq(f), rtol=1e-5, atol=1e-5)
    assert jax.jit(lambda f: f.dequantize())(f).dtype == jnp.bfloat16
    # a leading (stacked layers) axis passes through the leaves and dequantize
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), f, f)
    assert stacked.dequantize(jnp.float32).shape == (2, K, N)
    assert jax.tree.map(lambda a: a[1], stacked).dequantize(jnp.float32).shape == (K, N)


def test_quantize_unknown_format():
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize(np.zeros((64, 64), np.float32), "q9_z")


def test_linear_dot_dispatches_to_the_format():
    from surojax.models.layers.linear import dot
    f = quantize(_w(8), "q8_0")
    x = jnp.ones((2, K), jnp.bfloat16)
    y = dot(x, f)
    assert y.shape == (2, N) and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x @ f.dequantize(), np.float32), rtol=1e-2)
