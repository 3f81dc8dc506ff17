"""Distillation loss (surojax/losses/distill.py) and the teacher's top-K (surojax/train/teacher_topk.py) against
direct NumPy computations of the formulas."""
import jax
import jax.numpy as jnp
import numpy as np

from surojax.losses.distill import chunked_distill_loss, distill_terms
from surojax.train.teacher_topk import teacher_topk


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _numpy_terms(z, targets, mask, ids, logps, T):
    """Per position: p = top-K renormalised softmax(logps / T); log q = log_softmax(z / T)[ids]; KL = sum p (log p -
    log q); CE = -log_softmax(z)[target]. Sums over mask."""
    p = np.exp(logps / T) / np.exp(logps / T).sum(-1, keepdims=True)
    log_q = np.take_along_axis(_log_softmax(z / T), ids, -1)
    kl = (p * (np.log(p) - log_q)).sum(-1)
    ce = -np.take_along_axis(_log_softmax(z), targets[..., None], -1)[..., 0]
    return (kl * mask).sum(), (ce * mask).sum()


def _case(rng, B=2, T=5, V=40, K=6):
    z = rng.normal(size=(B, T, V)) * 2
    teacher = rng.normal(size=(B, T, V)) * 3
    ids = np.argsort(-teacher, -1)[..., :K].astype(np.int32)
    logps = np.take_along_axis(_log_softmax(teacher), ids, -1)
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = (rng.random((B, T)) > 0.3).astype(np.float32)
    return z, targets, mask, ids, logps, teacher


def test_kl_and_ce_equal_numpy():
    rng = np.random.default_rng(0)
    z, targets, mask, ids, logps, teacher = _case(rng)
    for T in (1.0, 2.5):
        kl, ce = distill_terms(jnp.asarray(z, jnp.float32), targets, mask, ids, jnp.asarray(logps, jnp.float32), T)
        ref_kl, ref_ce = _numpy_terms(z, targets, mask, ids, logps, T)
        np.testing.assert_allclose(float(kl), ref_kl, rtol=1e-5)
        np.testing.assert_allclose(float(ce), ref_ce, rtol=1e-5)
    # with K = V the top-K KL is the full KL(teacher || student) at T: sum_v p_v (log p_v - log q_v)
    V, T = z.shape[-1], 2.0
    all_ids = np.broadcast_to(np.arange(V, dtype=np.int32), z.shape)
    kl, _ = distill_terms(jnp.asarray(z, jnp.float32), targets, mask, all_ids,
                          jnp.asarray(_log_softmax(teacher), jnp.float32), T)
    log_p, log_q = _log_softmax(teacher / T), _log_softmax(z / T)
    full = ((np.exp(log_p) * (log_p - log_q)).sum(-1) * mask).sum()
    np.testing.assert_allclose(float(kl), full, rtol=1e-5)
    assert float(kl) > 0


def test_chunked_equals_one_chunk_in_value_and_gradient():
    """Chunks of 3 over 2 x 5 tokens (padded) vs the whole [B * T, V] at once: same sums and same gradients."""
    rng = np.random.default_rng(1)
    B, T, D, V = 2, 5, 8, 40
    _, targets, mask, ids, logps, _ = _case(rng, B, T, V)
    h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)

    def loss(h, w, chunk):
        kl, ce, n = chunked_distill_loss(h, w, targets, mask, ids, logps, temperature=2.0, chunk=chunk)
        return 0.7 * 4.0 * kl + 0.3 * ce, (kl, ce, n)

    (v3, (kl3, ce3, n3)), g3 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w, 3)
    (v, (kl, ce, n)), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w, B * T)
    ref_kl, ref_ce = _numpy_terms(np.einsum("btd,dv->btv", h, w), targets, mask, ids, logps, 2.0)
    np.testing.assert_allclose([float(kl3), float(ce3)], [ref_kl, ref_ce], rtol=1e-5)
    np.testing.assert_allclose(float(v3), float(v), rtol=1e-6)
    assert float(n3) == float(n) == mask.sum()
    for a, b in zip(g3, g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_teacher_topk_equals_numpy():
    """Top-K of the full-vocabulary log-softmax, ids past the tokenizer's (padding rows) never chosen, zeros where
    loss_mask is 0."""
    rng = np.random.default_rng(2)
    B, T, D, V, n_tokens, K = 2, 5, 8, 40, 36, 4
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    w = rng.normal(size=(D, V)).astype(np.float32)
    w[:, n_tokens:] += 10.0  # padding rows the teacher would otherwise prefer
    mask = (rng.random((B, T)) > 0.3).astype(np.float32)
    ids, logps = teacher_topk(jnp.asarray(h), jnp.asarray(w), mask, k=K, n_tokens=n_tokens, chunk=4)  # Tc = 2: 3 chunks
    lp = _log_softmax((h @ w)[..., :n_tokens])
    ref_ids = np.argsort(-lp, -1)[..., :K]
    keep = mask[..., None] > 0
    np.testing.assert_array_equal(np.asarray(ids), np.where(keep, ref_ids, 0))
    np.testing.assert_allclose(np.asarray(logps), np.where(keep, np.take_along_axis(lp, ref_ids, -1), 0), atol=1e-5)
