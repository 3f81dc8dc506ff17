"""target_logps equals log_softmax(h @ w / temperature) gathered at the targets, computed in numpy (float64) from
the formula, with a chunk that divides neither T nor N*T (a padded last chunk); so does its gradient,
d logp_t / d logits_t = (onehot(target_t) - softmax_t) / temperature."""
import jax
import jax.numpy as jnp
import numpy as np

from surojax.losses.token_logps import target_logps


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_target_logps_matches_numpy_log_softmax_gather():
    rng = np.random.default_rng(0)
    N, T, D, V, temperature = 3, 7, 8, 11, 0.7
    h = rng.normal(size=(N, T, D)).astype(np.float32)
    w = rng.normal(size=(D, V)).astype(np.float32)
    t = rng.integers(0, V, size=(N, T))
    cot = rng.normal(size=(N, T))

    logp_all = _log_softmax(h.astype(np.float64) @ w / temperature)  # [N, T, V]
    want = np.take_along_axis(logp_all, t[..., None], -1)[..., 0]
    d_logits = cot[..., None] * (np.eye(V)[t] - np.exp(logp_all)) / temperature  # [N, T, V]
    want_dh = d_logits @ w.T.astype(np.float64)
    want_dw = np.einsum("ntd,ntv->dv", h.astype(np.float64), d_logits)

    got = target_logps(jnp.asarray(h), jnp.asarray(w), jnp.asarray(t), temperature=temperature, chunk=5)
    assert got.shape == (N, T) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    dh, dw = jax.grad(lambda h, w: jnp.sum(target_logps(h, w, jnp.asarray(t), temperature=temperature, chunk=5)
                                           * cot), (0, 1))(jnp.asarray(h), jnp.asarray(w))
    np.testing.assert_allclose(dh, want_dh, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)
