"""Knowledge-distillation loss from a teacher's top-K log-probs, as pure functions (chunked over tokens).

Per supervised position t (shape legend: surojax/models/config.py; K = teacher_top_k):

    p_t   = softmax_K(teacher_logps[t] / T)        the teacher's top-K log-probs (full-vocab log-softmax at T = 1),
                                                   softened by T and RENORMALISED over its K ids
    log q = log_softmax_V(student_logits[t] / T)   the student's FULL softmax at T, read at the teacher's K ids
                                                   (not renormalised)
    kl_t  = sum_k p_t,k * (log p_t,k - log q_k)    >= 0 (Jensen: >= -log sum_k q_k)
    ce_t  = logsumexp_V(z) - z[target]             the usual CE on the label, at T = 1
    loss  = sum_t mask_t * (alpha * T^2 * kl_t + (1 - alpha) * ce_t)     (T^2: Hinton et al. 2015)

Renormalising the teacher over its top K is what top-K distillation does (Axolotl's and DistillKit's KD losses): it
makes the sidecar's log-probs, stored once at T = 1, valid for any temperature (softmax_K(log p / T) equals the
top-K renormalisation of softmax_V(z / T), since log p = z - logsumexp(z)). The student keeps its full softmax so the
mass it puts outside the teacher's top K is penalised.

Like `chunked_lm_loss`, `chunked_distill_loss` walks the flattened tokens in chunks of C rows: logits [C, V] in fp32
exist for one chunk at a time, under `jax.checkpoint` so the backward pass recomputes them per chunk instead of
keeping [B * T, V]. Memory is O(C * V).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from surojax.losses.lm import DEFAULT_CHUNK_TOKENS, soft_cap
from surojax.losses.router import RouterLossWeights, collected, router_loss


def distill_terms(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array, teacher_ids: jax.Array,
                  teacher_logps: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """logits [..., V] (computed in fp32), targets / loss_mask [...], teacher_ids / teacher_logps [..., K]
    -> (sum of KL(teacher || student) over supervised positions, sum of CE over them). Both sums are unscaled
    (no alpha, no T^2); positions with loss_mask 0 contribute nothing, whatever their teacher entries hold."""
    z = logits.astype(jnp.float32)
    mask = loss_mask.astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)  # [...]
    target_logit = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ce = lse - target_logit
    log_q_all = jax.nn.log_softmax(z / temperature, axis=-1)  # [..., V] the student's full softmax at T
    log_q = jnp.take_along_axis(log_q_all, teacher_ids.astype(jnp.int32), axis=-1)  # [..., K]
    log_p = jax.nn.log_softmax(teacher_logps.astype(jnp.float32) / temperature, axis=-1)  # [..., K] renormalised
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [...]
    return jnp.sum(kl * mask), jnp.sum(ce * mask)


def chunked_distill_loss(hidden: jax.Array, head_w: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                         teacher_ids: jax.Array, teacher_logps: jax.Array, *, temperature: float,
                         chunk: int = DEFAULT_CHUNK_TOKENS,
                         softcap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """hidden [B, T, D] (final-normed), head_w [D, V], targets / loss_mask [B, T], teacher_ids / teacher_logps
    [B, T, K] -> (KL sum, CE sum, supervised count), fp32 scalars; logits in chunks of `chunk` tokens (the
    student's logits soft-capped when `softcap` is set)."""
    B, T, D = hidden.shape
    K = teacher_ids.shape[-1]
    n = B * T
    chunk = min(chunk, n)
    pad = -n % chunk
    flat = {"h": hidden.reshape(n, D), "t": targets.reshape(n).astype(jnp.int32),
            "m": loss_mask.reshape(n).astype(jnp.float32), "ids": teacher_ids.reshape(n, K).astype(jnp.int32),
            "lp": teacher_logps.reshape(n, K).astype(jnp.float32)}
    k = (n + pad) // chunk
    xs = {name: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(k, chunk, *x.shape[1:])
          for name, x in flat.items()}
    w = head_w.astype(hidden.dtype)

    @jax.checkpoint  # the backward pass recomputes this chunk's logits instead of keeping all k of them
    def chunk_terms(c):
        logits = soft_cap(jnp.einsum("cd,dv->cv", c["h"], w, preferred_element_type=jnp.float32), softcap)  # [C, V]
        return distill_terms(logits, c["t"], c["m"], c["ids"], c["lp"], temperature)

    def body(carry, c):
        kl, ce = chunk_terms(c)
        return (carry[0] + kl, carry[1] + ce), None

    zero = jnp.zeros((), jnp.float32)
    (kl, ce), _ = jax.lax.scan(body, (zero, zero), xs)
    return kl, ce, jnp.sum(flat["m"])


def distill_loss(model, batch: dict, *, alpha: float, temperature: float, chunk: int = DEFAULT_CHUNK_TOKENS,
                 router: RouterLossWeights | None = None) -> tuple[jax.Array, dict]:
    """The distillation loss of a student `Decoder` on a packed batch (surojax/data/batch.py) that also carries
    the teacher's top-K: batch["teacher_ids"] int32 [B, T, K] and batch["teacher_logps"] float [B, T, K].

    Returns (sum over supervised tokens of alpha * T^2 * KL + (1 - alpha) * CE, {"tokens": count, "kl": KL sum,
    "ce": CE sum}); the step divides the loss by the accumulated count and sums "kl" / "ce" (divide them by
    "tokens" for the means). `router` (a MoE student): its router losses join the sum as in `lm_loss`.
    """
    inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
    h, _, stats = model.hidden_states(*inputs)
    if router is not None:
        stats = collected(stats)
    kl, ce, count = chunked_distill_loss(h, model.head_weight(), batch["targets"], batch["loss_mask"],
                                         batch["teacher_ids"], batch["teacher_logps"], temperature=temperature,
                                         chunk=chunk, softcap=model.cfg.final_logit_softcapping)
    total = alpha * temperature ** 2 * kl + (1.0 - alpha) * ce
    aux = {"tokens": count, "kl": jax.lax.stop_gradient(kl), "ce": jax.lax.stop_gradient(ce)}
    if router is not None:
        total = total + router_loss(stats, router) * count
        aux["router"] = jax.lax.stop_gradient(stats)
    return total, aux
