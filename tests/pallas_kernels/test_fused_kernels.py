"""The fused kernels (interpret mode on CPU, compiled Triton kernels on a GPU) equal x @ the format's own dequantize (one jnp.dot, fp32 accumulation), and
the package's reference (the same product over the kernel layout) equals that product exactly.

Tolerance. The kernel decodes the same bf16 weights as `dequantize(bf16)` (same float32 operations, then the same
cast), and bf16 x bf16 products are exact in float32, so kernel and reference differ only in the order of the fp32
sums (the kernel adds K in tiles, two half-tile dots for 4-bit codes). With fp32 outputs the test bounds that
elementwise: |y - y_ref| <= K * 2^-23 * (|x| @ |W|). With bf16 outputs both round that fp32 value once, so they
differ by at most one bf16 ulp of the result (plus the bound above)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_weights import KERNEL_FORMATS, make_weight
from pallas_kernels.quant_matmul.kernel import Tiles, forward, splits_for, transposed
from pallas_kernels.quant_matmul.layout import plain_layout
from pallas_kernels.quant_matmul.reference import forward_ref, transposed_ref

K, N, M = 256, 64, 40          # M = 40 is ragged for bm = 32: padded to 64 rows, sliced back
TILES = Tiles(bm=32, bn=32, kt=128)
INTERPRET = jax.default_backend() != "gpu"  # on the H200 the same tests run the compiled kernels


def _bound(a, b):
    a, b = np.abs(np.asarray(a, np.float32)), np.abs(np.asarray(b, np.float32))
    return a.shape[-1] * 2.0 ** -23 * (a @ b)


def _dot(a, w, out_dtype):
    """a @ w.dequantize(a.dtype), fp32 accumulation: the reference independent of the kernel layout."""
    return jnp.dot(a, w.dequantize(a.dtype), preferred_element_type=jnp.float32).astype(out_dtype)


def _dot_t(g, w, out_dtype):
    return jnp.dot(g, w.dequantize(g.dtype).T, preferred_element_type=jnp.float32).astype(out_dtype)


def _bf16_ulp(y):
    y = np.abs(np.asarray(y, np.float32))
    return np.exp2(np.floor(np.log2(np.maximum(y, 1e-30))) - 7)


@pytest.mark.parametrize("name", [f for f in KERNEL_FORMATS if f != "nf4-dq"])  # dq: same kernel as nf4
def test_kernels_equal_the_reference(name):
    w = make_weight(name, K, N)
    lw = w.kernel_layout(TILES.kt)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    wd = np.asarray(w.dequantize(jnp.bfloat16), np.float32)

    y = forward(x, lw, tiles=TILES, interpret=INTERPRET, out_dtype=jnp.float32)
    y_ref = _dot(x, w, jnp.float32)
    assert y.shape == (M, N)
    assert np.all(np.abs(np.asarray(y) - np.asarray(y_ref)) <= _bound(x, wd))

    dx = transposed(g, lw, tiles=TILES, interpret=INTERPRET, out_dtype=jnp.float32)
    dx_ref = _dot_t(g, w, jnp.float32)
    assert dx.shape == (M, K)
    assert np.all(np.abs(np.asarray(dx) - np.asarray(dx_ref)) <= _bound(g, wd.T))


@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_the_reference_is_the_product_with_dequantize(name):
    """forward_ref / transposed_ref over the kernel layout: the same bf16 weights, the same jnp.dot (eager)."""
    w = make_weight(name, K, N)
    lw = w.kernel_layout(TILES.kt)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(forward_ref(x, lw, jnp.float32)), np.asarray(_dot(x, w, jnp.float32)))
    np.testing.assert_array_equal(np.asarray(transposed_ref(g, lw)), np.asarray(_dot_t(g, w, jnp.bfloat16)))


@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
def test_swapped_tiles_and_few_rows(name):
    """swap (the transposed accumulator), kt = 256, bn = N, and M = 1 / 3 (bm shrinks to 16, padded)."""
    w = make_weight(name, K, N, seed=3)
    lw = w.kernel_layout(256)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, K)), jnp.bfloat16)
    tiles = Tiles(bm=128, bn=64, kt=256, swap=True)
    y = forward(x, lw, tiles=tiles, interpret=INTERPRET, out_dtype=jnp.float32)
    wd = np.asarray(w.dequantize(jnp.bfloat16), np.float32)
    assert np.all(np.abs(np.asarray(y) - np.asarray(_dot(x, w, jnp.float32))) <= _bound(x, wd))
    # in the compute dtype: within one bf16 ulp of the reference
    g = jnp.asarray(np.random.default_rng(3).standard_normal((3, N)), jnp.bfloat16)
    dx, dx_ref = transposed(g, lw, tiles=tiles, interpret=INTERPRET), _dot_t(g, w, jnp.bfloat16)
    assert dx.dtype == jnp.bfloat16 and dx.shape == (3, K)
    diff = np.abs(np.asarray(dx, np.float32) - np.asarray(dx_ref, np.float32))
    assert np.all(diff <= _bf16_ulp(dx_ref) + _bound(g, wd.T))


@pytest.mark.parametrize("name", ["q4_k", "nf4", "bfloat16"])  # nibble + offset, table, a plain weight
def test_decode_form_splits_k(name):
    """The decode form: M = 1 and 5 rows (one 16-row tile), K split over 2 and 4 programs (fp32 partials summed
    after); a plain bf16 weight through plain_layout. The bound as above, the split only reorders the sums."""
    if name == "bfloat16":
        wd = np.asarray(jnp.asarray(np.random.default_rng(6).standard_normal((512, N)), jnp.bfloat16), np.float32)
        lw, ref = plain_layout(jnp.asarray(wd, jnp.bfloat16)), lambda x: x.astype(jnp.float32) @ wd
    else:
        w = make_weight(name, 512, N, seed=6)
        lw, wd = w.kernel_layout(128), np.asarray(w.dequantize(jnp.bfloat16), np.float32)
        ref = lambda x: _dot(x, w, jnp.float32)  # noqa: E731
    tiles = Tiles(bm=64, bn=32, kt=128)
    for m, splits in ((1, 4), (5, 2)):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 512)), jnp.bfloat16)
        y = forward(x, lw, tiles=tiles, interpret=INTERPRET, out_dtype=jnp.float32, splits=splits)
        assert y.shape == (m, N) and y.dtype == jnp.float32
        assert np.all(np.abs(np.asarray(y) - np.asarray(ref(x))) <= 2 * _bound(x, wd))
    # a layer of a stacked weight, read in place (the layer index traced): the same bits as that layer alone
    stack = jax.tree.map(lambda a, b: jnp.stack([a, b]), plain_layout(jnp.zeros((512, N), jnp.bfloat16))
                         if name == "bfloat16" else make_weight(name, 512, N, seed=7).kernel_layout(128), lw)
    y1 = jax.jit(lambda x, st, i: forward(x, st, tiles=tiles, interpret=INTERPRET, splits=2, layer=i))(x, stack, 1)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(forward(x, lw, tiles=tiles, interpret=INTERPRET, splits=2)))
    assert splits_for(1, 512, N, tiles) == 4 and splits_for(1, 512, N, tiles, programs=4) == 2
    with pytest.raises(ValueError, match="splits=3 must divide the 4 K tiles"):
        forward(x, lw, tiles=tiles, interpret=INTERPRET, splits=3)


def test_bad_shapes_and_tiles_are_rejected():
    w = make_weight("q8_0", K, 48)
    lw = w.kernel_layout(128)
    x = jnp.ones((8, K), jnp.bfloat16)
    with pytest.raises(ValueError, match="x has K=128"):
        forward(jnp.ones((8, 128), jnp.bfloat16), lw, interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of 2"):
        forward(jnp.ones((64, K), jnp.bfloat16), lw, tiles=Tiles(bm=48, bn=16, kt=128), interpret=INTERPRET)
    with pytest.raises(ValueError, match="differs from the layout"):
        forward(x, lw, tiles=Tiles(kt=256), interpret=INTERPRET)
    with pytest.raises(ValueError, match="N=40"):
        make_weight("nf4", K, 40).kernel_layout(128)
    # N = 48 is not a multiple of bn = 32: the column tile shrinks to 16 and the result is still right
    y = forward(x, lw, tiles=Tiles(bm=16, bn=32, kt=128), interpret=INTERPRET, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(_dot(x, w, jnp.float32)), rtol=1e-5, atol=1e-5)
