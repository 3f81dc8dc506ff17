"""Language-modelling loss as pure functions of (hidden states or logits, batch) -> (loss sum, token count).

The loss of a step is the mean over the supervised tokens of the WHOLE accumulated batch, so these return
sums and counts, and the trainer divides once at the end (an average of micro-batch means would weight
tokens of short micro-batches more).

`chunked_lm_loss` never materialises fp32 logits [B, T, V] for the whole batch: it walks the flattened
tokens in chunks of `chunk` rows, computing logits [C, V] -> logsumexp - target logit per chunk under
a custom VJP whose forward also computes the gradients (d logits = softmax - onehot needs nothing from
above the loss), so each chunk's logits exist once, the two gradient GEMMs run in the compute dtype (bf16
on GPU) and the backward pass only scales dh [B*T, D] and dw [D, V]. Memory is O(C * V) instead of
O(B * T * V) (151,936 * 4 bytes per token for Qwen3: 0.6 MB a token).

Logit soft-capping (`ModelConfig.final_logit_softcapping`, Gemma 4: c): every loss over the head's logits reads
c * tanh(logits / c) (`soft_cap`, fp32), as transformers' CausalLM computes its logits; the LM loss's hand-written
gradient multiplies d logits by the cap's derivative 1 - tanh^2.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from surojax.losses.router import RouterLossWeights, collected, router_loss

DEFAULT_CHUNK_TOKENS = 4096


def lm_chunk_tokens(rows: int, sequence_len: int, lmhead_chunks: int) -> int:
    """Tokens per chunk of `chunked_lm_loss`: `lmhead_chunks` chunks over a micro-batch, or 4,096 by default."""
    if lmhead_chunks > 1:
        return max(1, math.ceil(rows * sequence_len / lmhead_chunks))
    return DEFAULT_CHUNK_TOKENS


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [..., V] (any float dtype, computed in fp32), targets/loss_mask [...] -> (sum of CE, count)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum((lse - target_logit) * mask), jnp.sum(mask)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) in fp32 (logit soft-capping; None: the logits unchanged)."""
    if cap is None:
        return logits
    return jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))


def chunked_lm_loss(hidden: jax.Array, head_w: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                    chunk: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """hidden [B, T, D] (final-normed), head_w [D, V] -> (sum of CE over supervised tokens, count).

    Logits are computed in chunks of `chunk` tokens, in the hidden dtype with fp32 accumulation; `softcap` c:
    the CE of c * tanh(logits / c).
    """
    B, T, D = hidden.shape
    n = B * T
    h, tg, m = token_chunks(chunk, hidden.reshape(n, D), targets.reshape(n).astype(jnp.int32),
                            loss_mask.reshape(n).astype(jnp.float32))
    return _chunked_ce(h, head_w.astype(hidden.dtype), tg, m, softcap), jnp.sum(m)


def token_chunks(chunk: int, *flat: jax.Array) -> list[jax.Array]:
    """Arrays [n, ...] over the same n tokens -> each [k, C, ...]: C = min(chunk, n) tokens a chunk, the last chunk
    zero-padded (a padded token has hidden 0, target 0 and mask 0: the caller drops or masks it)."""
    n = flat[0].shape[0]
    chunk = min(chunk, n)
    pad = -n % chunk
    k = (n + pad) // chunk
    return [jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(k, chunk, *x.shape[1:]) for x in flat]


def chunk_logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [C, D] @ w [D, V] -> logits [C, V] in fp32 (operands in the compute dtype, fp32 accumulation)."""
    return jnp.einsum("cd,dv->cv", h, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_ce(h, w, t, m, cap=None):
    """Sum of CE over k chunks: h [k, C, D], w [D, V] (both in the compute dtype), targets/mask [k, C]; `cap`
    (static) the logits' soft cap or None."""
    def body(total, xs):
        hc, tc, mc = xs
        return total + cross_entropy_sum(soft_cap(chunk_logits(hc, w), cap), tc, mc)[0], None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (h, t, m))[0]


def _chunked_ce_fwd(h, w, t, m, cap=None):
    """The loss AND its gradients for an upstream cotangent of 1, chunk by chunk: the gradient of a CE sum
    needs nothing from above the loss, so each chunk's logits are computed once and the backward pass only
    scales dh [k, C, D] and dw [D, V] (no second logits GEMM, no second softmax over V). Where `w` takes no
    gradient (LoRA's frozen head), dw is dead code and XLA drops its GEMM and accumulator."""
    def body(carry, xs):
        total, dw = carry
        hc, tc, mc = xs
        logits = chunk_logits(hc, w)
        if cap is not None:  # capped = c tanh(z / c); d capped / d z = 1 - tanh^2
            tanh = jnp.tanh(logits / jnp.float32(cap))
            logits = jnp.float32(cap) * tanh
        lse = jax.nn.logsumexp(logits, axis=-1)  # [C]
        target_logit = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        # softmax - onehot as one elementwise pass over the fp32 logits (a compare with the target column, not a
        # scatter into a materialised [C, V] copy: same values, one read of the logits and one bf16 write)
        onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == tc[:, None]
        p = jnp.exp(logits - lse[:, None]) - onehot.astype(jnp.float32)
        if cap is not None:
            p = p * (1.0 - tanh * tanh)
        d_logits = (p * mc[:, None]).astype(hc.dtype)  # [C, V] in the compute dtype: both GEMMs run in it
        dh = jnp.einsum("cv,dv->cd", d_logits, w)  # [C, D] compute dtype (fp32 accumulation inside the GEMM)
        dw = dw + jnp.einsum("cd,cv->dv", hc, d_logits, preferred_element_type=jnp.float32)
        return (total + jnp.sum((lse - target_logit) * mc), dw), dh

    zero_dw = jnp.zeros(w.shape, jnp.float32)
    (total, dw), dh = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zero_dw), (h, t, m))
    return total, (dh, dw.astype(w.dtype))


def _chunked_ce_bwd(cap, res, g):
    dh, dw = res
    return (dh * g.astype(dh.dtype)).astype(dh.dtype), (dw * g.astype(dw.dtype)).astype(dw.dtype), None, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def lm_loss(model, batch: dict, *, chunk: int = DEFAULT_CHUNK_TOKENS,
            router: RouterLossWeights | None = None) -> tuple[jax.Array, dict]:
    """The causal-LM loss of a `Decoder` on a packed batch (see surojax/data/batch.py).

    Returns (sum of CE over supervised tokens, {"tokens": count}); divide by the accumulated count. A
    vision-language batch also holds `images` (ImageInputs) and `rope_positions` [3, B, T] (train/image_inputs.py),
    passed to `hidden_states`.

    `router` (a MoE model only): the router losses join the sum as `(aux_coef * aux + z_coef * z) * count`, the
    micro-batch's own aux and z (surojax.losses.router) weighted by its supervised tokens, so that after the
    division by the count one micro-batch gives HF's `loss + router_aux_loss_coef * aux_loss`; the metrics then
    also hold "router": the layers' `RouterStats` [L, ...] (sums over the micro-batch's real tokens, no gradient).
    """
    if router is not None and model.cfg.moe is None:
        raise ValueError("router losses need a mixture-of-experts model; this one is dense")
    h, _, stats = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"],
                                      images=batch.get("images"), rope_positions=batch.get("rope_positions"))
    if router is None:
        total, count = chunked_lm_loss(h, model.head_weight(), batch["targets"], batch["loss_mask"], chunk,
                                       model.cfg.final_logit_softcapping)
        return total, {"tokens": count}
    stats = collected(stats)
    total, count = chunked_lm_loss(h, model.head_weight(), batch["targets"], batch["loss_mask"], chunk,
                                   model.cfg.final_logit_softcapping)
    total = total + router_loss(stats, router) * count
    return total, {"tokens": count, "router": jax.lax.stop_gradient(stats)}
