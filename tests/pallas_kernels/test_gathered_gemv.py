"""The gathered GEMV kernel (pallas_kernels/gathered_gemv, interpret mode on CPU) against the XLA gathered path it
replaces (pallas_kernels.grouped_matmul.gathered) and a float64 numpy reference of the same math (w cast to x's
dtype, exact products and sums, y in x's dtype); the mode choice and the gradient of the dispatching call."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gathered_gemv import GatheredTiles, choose, gathered_gemv
from pallas_kernels.gathered_gemv import api as gemv_api
from pallas_kernels.grouped_matmul.gathered import gathered_dot
from tests.tolerances import reorder_atol


def _operands(a, i, o, e, x_dtype, w_dtype, seed=0):
    kx, kw, ki = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (a, i), jnp.float32).astype(x_dtype)
    w = jax.random.normal(kw, (e, i, o), jnp.float32).astype(w_dtype)
    ids = jax.random.randint(ki, (a,), 0, e, jnp.int32)
    if a > 1:
        ids = ids.at[-1].set(ids[0])  # an expert routed by two rows
    return x, w, ids


def _reference_f64(x, w, ids):
    """y[a] = x[a] @ w[ids[a]], w rounded to x's dtype first, the products and sums exact (float64)."""
    w_x = np.asarray(jnp.asarray(w).astype(x.dtype).astype(jnp.float32), np.float64)
    return np.einsum("ai,aio->ao", np.asarray(x.astype(jnp.float32), np.float64), w_x[np.asarray(ids)])


CASES = [  # A, I, O, E, x dtype, w dtype, tiles (bi, bo)
    (1, 64, 96, 3, jnp.float32, jnp.float32, (16, 32)),      # one row, both dimensions multiples of the tiles
    (8, 40, 64, 4, jnp.float32, jnp.float32, (16, 32)),      # I = 40 not a multiple of bi = 16
    (8, 64, 70, 5, jnp.bfloat16, jnp.bfloat16, (32, 32)),    # O = 70 not a multiple of bo = 32
    (3, 100, 50, 4, jnp.bfloat16, jnp.float32, (32, 64)),    # both ragged, fp32 w cast to bf16 in the kernel
]


@pytest.mark.parametrize("a,i,o,e,x_dtype,w_dtype,tiles", CASES)
def test_kernel_equals_the_xla_gather_and_the_float64_reference(a, i, o, e, x_dtype, w_dtype, tiles):
    x, w, ids = _operands(a, i, o, e, x_dtype, w_dtype)
    y = gathered_gemv(x, w, ids, tiles=GatheredTiles(*tiles), interpret=True)
    assert y.shape == (a, o) and y.dtype == x_dtype
    ref64 = _reference_f64(x, w, ids)
    xla = np.asarray(gathered_dot(x, w, ids, kernel="xla").astype(jnp.float32))
    got = np.asarray(y.astype(jnp.float32))
    terms = np.abs(np.asarray(x.astype(jnp.float32), np.float64))[:, :, None] * \
        np.abs(np.asarray(jnp.asarray(w).astype(x_dtype).astype(jnp.float32), np.float64)[np.asarray(ids)])
    acc_atol = reorder_atol(i, np.float32, terms.sum(axis=1).max())  # fp32 sums in another order
    if x_dtype == jnp.float32:
        np.testing.assert_allclose(got, ref64, rtol=0, atol=acc_atol)
        np.testing.assert_allclose(got, xla, rtol=0, atol=acc_atol)
    else:  # y rounded to bf16: half an ulp from the exact value, one ulp between two roundings of near sums
        ulp = float(jnp.finfo(x_dtype).eps) * np.abs(ref64)
        np.testing.assert_array_less(np.abs(got - ref64), 0.5 * ulp + acc_atol + 1e-30)
        np.testing.assert_array_less(np.abs(got - xla), ulp + acc_atol + 1e-30)


def test_a_layer_stack_is_read_in_place_at_its_layer():
    x, w, ids = _operands(4, 32, 48, 3, jnp.float32, jnp.float32)
    stack = jnp.stack([w * 0.5, w, w * -2.0])  # [L, E, I, O]
    tiles = GatheredTiles(16, 16)
    want = gathered_gemv(x, w, ids, tiles=tiles, interpret=True)
    got = gathered_gemv(x, stack, ids, layer=jnp.int32(1), tiles=tiles, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    xla = gathered_dot(x, stack, ids, layer=jnp.int32(1), kernel="xla")  # the XLA path's gather from the stack
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(gathered_dot(x, w, ids, kernel="xla")))
    with pytest.raises(ValueError, match="needs the layer index"):
        gathered_gemv(x, stack, ids, interpret=True)
    with pytest.raises(ValueError, match="layer index given"):
        gathered_gemv(x, w, ids, layer=0, interpret=True)


def test_choose_takes_the_kernel_only_under_pallas_for_a_plain_weight_on_a_gpu(monkeypatch):
    w = jnp.zeros((2, 4, 4), jnp.bfloat16)
    assert choose(w, "pallas") == "xla"  # off a GPU (this CPU) the mode is ignored by design
    with pytest.raises(ValueError, match="gathered GEMV mode 'fast'"):
        choose(w, "fast")
    monkeypatch.setattr(gemv_api, "on_gpu", lambda: True)
    assert choose(w, "pallas") == "pallas"
    assert choose(w, "auto") == "pallas" and choose(w, "xla") == "xla"  # auto: the kernel (measured on an H100)
    assert choose(object(), "pallas") == "xla"  # a quantised weight (a pytree, not an array)
    assert choose(jnp.zeros((2, 4, 4), jnp.int8), "pallas") == "xla"


def test_the_kernel_call_has_the_xla_paths_gradient(monkeypatch):
    """gathered_dot under pallas (the choice forced as on a GPU, the kernel in interpret mode): the forward is the
    kernel's (it runs: counted), the gradients w.r.t. x and w are the XLA path's backward."""
    calls = []
    monkeypatch.setattr(gemv_api, "on_gpu", lambda: True)
    import pallas_kernels.grouped_matmul.gathered as gathered

    def counted(*args, **kw):
        calls.append(1)
        return gemv_api.gathered_gemv(*args, interpret=True, **kw)

    monkeypatch.setattr(gathered, "gathered_gemv", counted)
    x, w, ids = _operands(8, 32, 24, 4, jnp.float32, jnp.float32)
    cot = jax.random.normal(jax.random.key(3), (8, 24))

    def loss(kernel):
        return lambda x, w: jnp.sum(gathered_dot(x, w, ids, kernel=kernel) * cot)

    gk = jax.grad(loss("pallas"), argnums=(0, 1))(x, w)
    assert calls
    gx = jax.grad(loss("xla"), argnums=(0, 1))(x, w)
    for a, b in zip(gk, gx, strict=True):  # the cotangent is fixed: the same backward, bit for bit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
