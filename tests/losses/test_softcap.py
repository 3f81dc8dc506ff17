"""Logit soft-capping (`ModelConfig.final_logit_softcapping`, Gemma 4) in every loss over the head's logits: each
chunked form equals its definition on the capped logits c * tanh(h @ w / c), computed whole: the LM loss's value
and its hand-written gradients (dh, dw) against autodiff of the plain CE, the target log-probs (DPO / GRPO), the
distillation terms and the teacher's top-k. A cap of 2 on logits of scale ~5 changes every one of them."""
import jax
import jax.numpy as jnp
import numpy as np

from surojax.losses.distill import chunked_distill_loss, distill_terms
from surojax.losses.lm import chunked_lm_loss, cross_entropy_sum
from surojax.losses.token_logps import target_logps
from surojax.train.teacher_topk import teacher_topk

CAP = 2.0
B, T, D, V, K = 2, 5, 8, 16, 3


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    h = jax.random.normal(ks[0], (B, T, D), jnp.float32)
    w = 2.0 * jax.random.normal(ks[1], (D, V), jnp.float32)
    targets = jax.random.randint(ks[2], (B, T), 0, V)
    mask = (jax.random.uniform(ks[3], (B, T)) > 0.3).astype(jnp.float32)
    return h, w, targets, mask


def _capped(h, w):
    return CAP * jnp.tanh(jnp.einsum("btd,dv->btv", h, w) / CAP)


def test_lm_loss_value_and_gradients():
    h, w, targets, mask = _inputs()
    assert float(jnp.abs(jnp.einsum("btd,dv->btv", h, w)).max()) > 3 * CAP  # the cap bites

    def chunked(h, w):
        return chunked_lm_loss(h, w, targets, mask, chunk=4, softcap=CAP)[0]

    def whole(h, w):
        return cross_entropy_sum(_capped(h, w), targets, mask)[0]

    got, want = jax.value_and_grad(chunked, (0, 1))(h, w), jax.value_and_grad(whole, (0, 1))(h, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, e in zip(got[1], want[1]):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    uncapped = chunked_lm_loss(h, w, targets, mask, chunk=4)[0]
    assert abs(float(uncapped) - float(got[0])) > 1.0


def test_target_logps():
    h, w, targets, _ = _inputs()
    want = jnp.take_along_axis(jax.nn.log_softmax(_capped(h, w) / 0.7), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(target_logps(h, w, targets, temperature=0.7, chunk=4, softcap=CAP), want,
                               rtol=1e-5, atol=1e-6)


def test_distill_terms_and_teacher_topk():
    h, w, targets, mask = _inputs()
    ids, logps = teacher_topk(h, w, mask, k=K, n_tokens=V, chunk=4, softcap=CAP)
    full = jax.nn.log_softmax(_capped(h, w))
    want_logps, want_ids = jax.lax.top_k(full, K)
    keep = mask[..., None] > 0
    np.testing.assert_array_equal(np.where(keep, ids, 0), np.where(keep, want_ids, 0))
    np.testing.assert_allclose(np.where(keep, logps, 0), np.where(keep, want_logps, 0), rtol=1e-5, atol=1e-6)
    got = chunked_distill_loss(h, w, targets, mask, want_ids, want_logps, temperature=1.5, chunk=4, softcap=CAP)
    want = distill_terms(_capped(h, w), targets, mask, want_ids, want_logps, 1.5)
    np.testing.assert_allclose(got[:2], want, rtol=1e-5, atol=1e-6)
