"""The chunked LM loss equals the plain computation (full fp32 logits, logsumexp - target logit): value and
gradients, with padding (token count not a multiple of the chunk), any upstream cotangent, and in bf16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.losses.lm import chunked_lm_loss, cross_entropy_sum

B, T, D, V = 3, 7, 16, 50  # 21 tokens: chunks of 4 leave a padded last chunk


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(B, T, D)), dtype)
    w = jnp.asarray(rng.normal(size=(D, V)) / np.sqrt(D), dtype)
    t = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
    m = jnp.asarray(rng.random((B, T)) > 0.3, jnp.int32)
    return h, w, t, m


def _plain(h, w, t, m):
    logits = jnp.einsum("btd,dv->btv", h.astype(jnp.float32), w.astype(jnp.float32))
    return cross_entropy_sum(logits, t, m)


@pytest.mark.parametrize("chunk", [4, 21, 64])
def test_chunked_equals_plain_fp32_value_and_grads(chunk):
    h, w, t, m = _inputs(jnp.float32)
    got, count = chunked_lm_loss(h, w, t, m, chunk)
    want, want_count = _plain(h, w, t, m)
    assert float(count) == float(want_count) == float(m.sum()) > 0
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    # a non-unit upstream cotangent (a mean loss): the backward scales the gradients computed in the forward
    scale = 1.0 / float(count)
    g_got = jax.grad(lambda h, w: chunked_lm_loss(h, w, t, m, chunk)[0] * scale, argnums=(0, 1))(h, w)
    g_want = jax.grad(lambda h, w: _plain(h, w, t, m)[0] * scale, argnums=(0, 1))(h, w)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        assert float(jnp.abs(b).max()) > 1e-3
    # masked-out tokens get no gradient
    dh = np.asarray(g_got[0])
    assert np.all(dh[np.asarray(m) == 0] == 0)


def test_chunked_bf16_is_close_to_fp32_truth():
    h, w, t, m = _inputs(jnp.bfloat16, seed=1)
    got, _ = chunked_lm_loss(h, w, t, m, 4)
    want, _ = _plain(h, w, t, m)  # bf16 operands, fp32 math
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    g_got = jax.grad(lambda h, w: chunked_lm_loss(h, w, t, m, 4)[0], argnums=(0, 1))(h, w)
    g_want = jax.grad(lambda h, w: _plain(h, w, t, m)[0], argnums=(0, 1))(h.astype(jnp.float32), w.astype(jnp.float32))
    for a, b in zip(g_got, g_want):
        assert a.dtype == jnp.bfloat16
        rel = float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        assert rel < 2e-2, rel


def test_frozen_head_costs_no_weight_gradient_gemm():
    """With the head frozen (LoRA) the dw GEMM and its accumulator are dead code: the compiled gradient has
    one dot fewer than with dw requested."""
    h, w, t, m = _inputs(jnp.float32)

    def dots(argnums):
        f = jax.jit(jax.grad(lambda h, w: chunked_lm_loss(h, w, t, m, 4)[0], argnums=argnums))
        return f.lower(h, w).compile().as_text().count(" dot(")

    assert dots((0,)) < dots((0, 1))


def test_chunked_ce_gradient_pass_has_no_scatter():
    """d logits = softmax - onehot is one elementwise pass (a compare with the target column): a scatter into
    the [C, V] probabilities would materialise them (measured on the H200: the loss is memory-bound)."""
    import jax
    import jax.numpy as jnp

    from surojax.losses.lm import _chunked_ce_fwd

    args = (jnp.zeros((2, 8, 4), jnp.bfloat16), jnp.zeros((4, 50), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32),
            jnp.ones((2, 8), jnp.float32))
    hlo = jax.jit(_chunked_ce_fwd).lower(*args).as_text()
    assert "scatter" not in hlo
