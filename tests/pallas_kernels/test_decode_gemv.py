"""The decode GEMV (pallas_kernels/decode_gemv) in interpret mode against its pure-jnp reference, which computes the
decoder's own operations (RMSNorm, the product, act(gate) * up, the residual) in the model's order and dtypes.

Shapes are Qwen3-0.6B's linears (qkv [4096, 1024], o [1024, 2048], gate_up [6144, 1024], down [1024, 3072]) at
M = 1 and 3 rows, with large tiles so that interpret mode runs few programs. Tolerance: fp32 results differ from
the reference only by the order of the K sum (tests/tolerances.py's reorder bound); bf16 results may differ by one
rounding of each bf16 step (the product, the activation, the gated product, the residual sum), which a chain of
them turns into 2 bf16 ulps of the largest intermediate; but nearly every element must be the same bf16 number.
The tensor-core body (GemvTiles.dot) is checked the same way at 1, 9, 16 and 64 rows (padded in the kernel to 16,
16, 16, 64), on small shapes."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemv import GemvTiles, decode_gemv, decode_gemv_ref, tiles_for
from pallas_kernels.decode_gemv.kernel import MAX_DOT_ROWS, MAX_ROWS
from tests.tolerances import reorder_atol

BIG = GemvTiles(bn=256, bk=1024)  # few programs in interpret mode (fit shrinks them to divisors)
CASES = {  # name: (M, K, N, stacked, options)
    "qkv": (1, 1024, 4096, False, {}),
    "o_residual": (3, 2048, 1024, True, {"residual": True}),
    "gate_up_norm_silu": (3, 1024, 6144, True, {"norm": "plain", "activation": "silu"}),
    "down_residual": (1, 3072, 1024, False, {"residual": True}),
    "gemma_norm_gelu": (3, 1024, 6144, False, {"norm": "zero_centered", "activation": "gelu_tanh", "residual": True}),
}


def _operands(m, k, n, stacked, opts, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((2, n, k) if stacked else (n, k)) * k ** -0.5, dtype)
    n_out = n // 2 if opts.get("activation") else n
    kw = {"activation": opts.get("activation")}
    if opts.get("norm"):
        kw.update(norm=opts["norm"], eps=1e-6,
                  norm_weight=jnp.asarray(rng.standard_normal(k) * 0.1 + (0 if opts["norm"] == "zero_centered" else 1),
                                          dtype))
    if opts.get("residual"):
        kw["residual"] = jnp.asarray(rng.standard_normal((m, n_out)), dtype)
    return x, w, kw


def _reference(x, w, kw, layer):
    return decode_gemv_ref(x, w[layer] if layer is not None else w, norm=kw.get("norm_weight"),
                           eps=kw.get("eps", 1e-6), zero_centered=kw.get("norm") == "zero_centered",
                           activation=kw.get("activation"), residual=kw.get("residual"))


def _check(got, want, k, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.max(np.abs(want)))
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=reorder_atol(k, np.float32, scale))
    else:
        np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=2 ** -6 * scale)
        # nearly every value the same bf16 number: a wrong layer, row or epilogue is off by O(the values) everywhere
        assert np.mean(got != want) < 0.05


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(case, dtype):
    m, k, n, stacked, opts = CASES[case]
    x, w, kw = _operands(m, k, n, stacked, opts, dtype)
    layer = 1 if stacked else None
    got = decode_gemv(x, w, layer=layer, tiles=BIG, interpret=True, **kw)
    want = _reference(x, w, kw, layer)
    assert got.shape == want.shape == (m, n // 2 if opts.get("activation") else n)
    _check(got, want, k, dtype)


DOT = GemvTiles(bn=32, bk=128, dot=True)
DOT_CASES = {  # name: (M, K, N, stacked, options); K 256 (two K steps), N_out 64..128 (2..4 programs)
    "m1_norm_silu_residual": (1, 256, 128, True, {"norm": "plain", "activation": "silu", "residual": True}),
    "m9_plain": (9, 256, 128, True, {}),
    "m16_gemma_norm_gelu_residual": (16, 256, 128, False,
                                     {"norm": "zero_centered", "activation": "gelu_tanh", "residual": True}),
    "m64_norm_residual": (64, 256, 64, True, {"norm": "plain", "residual": True}),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(DOT_CASES))
def test_the_dot_body_matches_the_reference(case, dtype):
    """The tensor-core body with every fused form, its rows padded in the kernel (1 and 9 rows -> 16), a layer of a
    stack read in place."""
    m, k, n, stacked, opts = DOT_CASES[case]
    x, w, kw = _operands(m, k, n, stacked, opts, dtype, seed=m)
    layer = 1 if stacked else None
    got = decode_gemv(x, w, layer=layer, tiles=DOT, interpret=True, **kw)
    want = _reference(x, w, kw, layer)
    assert got.shape == want.shape == (m, n // 2 if opts.get("activation") else n)
    _check(got, want, k, dtype)


@pytest.mark.parametrize("tiles", [GemvTiles(bn=64, bk=128), DOT], ids=["fma", "dot"])
def test_a_stacked_norm_weight_is_read_at_its_row(tiles):
    """A norm weight given as a layer stack [L, K] with norm_layer (a StackedVector's, read in place) gives the
    same bits as its row given alone, in both bodies."""
    x, w, kw = _operands(3, 256, 128, True, {"norm": "plain", "activation": "silu"}, jnp.bfloat16, seed=5)
    rng = np.random.default_rng(6)
    stack = jnp.asarray(1 + 0.1 * rng.standard_normal((3, 256)), jnp.bfloat16)
    kw = {**kw, "norm_weight": stack[2]}
    want = decode_gemv(x, w, layer=1, tiles=tiles, interpret=True, **kw)
    got = decode_gemv(x, w, layer=1, tiles=tiles, interpret=True, **{**kw, "norm_weight": stack}, norm_layer=2)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="with the row to read"):
        decode_gemv(x, w, layer=1, tiles=tiles, interpret=True, **{**kw, "norm_weight": stack})


def test_the_dot_body_gives_fp32_sums_for_a_tied_head():
    """out_dtype float32 (Decoder.logits' tied head) at 9 rows of bf16: the fp32 sums of the bf16 products,
    unrounded, as the einsum with preferred_element_type float32 gives them."""
    x, w, _ = _operands(9, 256, 128, False, {}, jnp.bfloat16, seed=3)
    got = decode_gemv(x, w, tiles=DOT, interpret=True, out_dtype=jnp.float32)
    want = jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32 and got.shape == (9, 128)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=reorder_atol(256, np.float32, float(jnp.max(jnp.abs(want)))))


def test_the_deferred_sum_matches_the_reference():
    """tiles.deferred (elementwise [bn, bk] accumulators, one sum after the loop) with every fused form, fp32."""
    from pallas_kernels.decode_gemv.kernel import deferred_for

    tiles = GemvTiles(bn=8, bk=128, deferred=True)
    assert deferred_for(tiles, 3 * 2) and not deferred_for(tiles, 8 * 2 * 2)  # the register budget
    opts = {"norm": "plain", "activation": "silu", "residual": True}
    x, w, kw = _operands(3, 512, 256, True, opts, jnp.float32, seed=2)
    got = decode_gemv(x, w, layer=0, tiles=tiles, interpret=True, **kw)
    want = _reference(x, w, kw, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=reorder_atol(512, np.float32, float(np.max(np.abs(want)))))


def test_default_tiles_cover_odd_widths_and_refuse_what_they_cannot():
    """N off the default column block is handled (the block shrinks to a power-of-2 divisor); widths and Ks the
    smallest blocks cannot tile, and more rows than a body takes, are refused by name. The default tiles take the
    FMA body up to MAX_ROWS rows, the dot body above (bn from the padded rows, halved while the grid is small)."""
    t = tiles_for(3000, 1024)
    assert 3000 % t.bn == 0 and 1024 % t.bk == 0 and t.bn == 8 and not t.dot
    assert not tiles_for(4096, 4096, MAX_ROWS).dot
    assert [(t.dot, t.bn) for t in (tiles_for(12288, 4096, m) for m in (9, 64))] == [(True, 16), (True, 64)]
    assert tiles_for(4096, 4096, 64).bn == 16  # 64 columns a program would leave 64 programs for 132 SMs
    x, w, _ = _operands(2, 256, 40, False, {}, jnp.float32, seed=1)  # 40 columns: bn 16 -> 8
    got = decode_gemv(x, w, tiles=GemvTiles(bn=16, bk=64), interpret=True)
    np.testing.assert_allclose(got, _reference(x, w, {}, None), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"output width 1002 of weight \[1002, 256\]"):
        decode_gemv(jnp.zeros((1, 256)), jnp.zeros((1002, 256)), interpret=True)
    with pytest.raises(ValueError, match="K=1000 of weight"):
        decode_gemv(jnp.zeros((1, 1000)), jnp.zeros((64, 1000)), interpret=True)
    with pytest.raises(ValueError, match=f"9 rows, the FMA kernel takes 1..{MAX_ROWS}"):
        decode_gemv(jnp.zeros((9, 256)), jnp.zeros((64, 256)), tiles=GemvTiles(), interpret=True)
    with pytest.raises(ValueError, match=f"65 rows, the dot kernel takes 1..{MAX_DOT_ROWS}"):
        decode_gemv(jnp.zeros((65, 256)), jnp.zeros((64, 256)), interpret=True)
    with pytest.raises(ValueError, match="output width 40 .* not a multiple of 16 .*dot body"):
        decode_gemv(jnp.zeros((9, 256)), jnp.zeros((40, 256)), interpret=True)
    with pytest.raises(ValueError, match="needs the layer index"):
        decode_gemv(jnp.zeros((1, 256)), jnp.zeros((2, 64, 256)), interpret=True)


def test_lowers_to_triton_for_an_h200():
    """Every fused form lowers through Pallas' Triton lowering (the offline sm_90 compile of these modules:
    benchmarks/triton_offline_check.py dump-gemv)."""
    from tests.pallas_kernels.test_triton_lowering import TRITON, _lower

    x, w, kw = _operands(8, 1024, 6144, True, CASES["gate_up_norm_silu"][4], jnp.bfloat16)
    fn = lambda x, w, i, nw: decode_gemv(x, w, layer=i, norm_weight=nw, norm="plain", activation="silu",  # noqa: E731
                                         interpret=False)
    assert TRITON in _lower(fn, x, w, jnp.int32(1), kw["norm_weight"])
    r = jnp.zeros((1, 1024), jnp.bfloat16)
    assert TRITON in _lower(lambda x, w, r: decode_gemv(x, w, residual=r, interpret=False), x[:1], w[0, :1024], r)
    # the dot body: 64 rows gated with the norm; 9 rows (masked to 16) with the residual; a float32 head
    x64 = jnp.zeros((64, 1024), jnp.bfloat16)
    assert TRITON in _lower(fn, x64, w, jnp.int32(1), kw["norm_weight"])
    r9 = jnp.zeros((9, 1024), jnp.bfloat16)
    assert TRITON in _lower(lambda x, w, r: decode_gemv(x, w, residual=r, interpret=False), x64[:9], w[0, :1024], r9)
    assert TRITON in _lower(lambda x, w: decode_gemv(x, w, out_dtype=jnp.float32, interpret=False), x64[:16], w[0])


def test_the_mode_choice(monkeypatch):
    """pallas: the kernel up to MAX_DOT_ROWS rows; xla: never; auto: only on a GPU and up to the measured
    AUTO_MAX_M (8 since session 23's H100 run), above it up to AUTO_DOT_MAX_M (64 since session 29's), weights
    laid out for it only where it can be taken."""
    from pallas_kernels.decode_gemv import api

    assert [api.choose(m, "pallas") for m in (1, MAX_ROWS + 1, MAX_DOT_ROWS, MAX_DOT_ROWS + 1)] == \
        ["pallas", "pallas", "pallas", "xla"]
    assert api.converts("pallas") and not api.converts("xla") and api.choose(1, "xla") == "xla"
    monkeypatch.setattr(api, "on_gpu", lambda: True)
    assert api.converts("auto") and [api.choose(m, "auto") for m in (1, 8, 9, 64, 65)] == \
        ["pallas", "pallas", "pallas", "pallas", "xla"]
    monkeypatch.setattr(api, "AUTO_DOT_MAX_M", 32)
    assert [api.choose(m, "auto") for m in (9, 32, 33)] == ["pallas", "pallas", "xla"]
    monkeypatch.setattr(api, "AUTO_MAX_M", 0)
    assert api.converts("auto") and [api.choose(m, "auto") for m in (1, 9)] == ["xla", "pallas"]
    monkeypatch.setattr(api, "AUTO_DOT_MAX_M", 0)
    assert not api.converts("auto") and api.choose(1, "auto") == "xla"
    monkeypatch.setattr(api, "AUTO_MAX_M", 4)
    assert api.converts("auto") and [api.choose(m, "auto") for m in (4, 5)] == ["pallas", "xla"]
    monkeypatch.setattr(api, "on_gpu", lambda: False)
    assert not api.converts("auto") and api.choose(1, "auto") == "xla"
    with pytest.raises(ValueError, match="decode_gemv mode 'fast'"):
        api.choose(1, "fast")
