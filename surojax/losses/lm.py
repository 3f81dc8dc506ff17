"""Language-modelling loss as pure functions of (hidden states or logits, batch) -> (loss sum, token count).

The loss of a step is the mean over the supervised tokens of the WHOLE accumulated batch, so these return
sums and counts, and the trainer divides once at the end (an average of micro-batch means would weight
tokens of short micro-batches more).

`chunked_lm_loss` never materialises fp32 logits [B, T, V] for the whole batch: it walks the flattened
tokens in chunks of `chunk` rows, computing logits [C, V] -> logsumexp - target logit per chunk under
a custom VJP, so the backward pass recomputes each chunk's logits instead of storing them and runs its
two GEMMs in the compute dtype (bf16 on GPU). Memory is
O(C * V) instead of O(B * T * V) (151,936 * 4 bytes per token for Qwen3: 0.6 MB a token).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

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


def chunked_lm_loss(hidden: jax.Array, head_w: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                    chunk: int = DEFAULT_CHUNK_TOKENS) -> tuple[jax.Array, jax.Array]:
    """hidden [B, T, D] (final-normed), head_w [D, V] -> (sum of CE over supervised tokens, count).

    Logits are computed in chunks of `chunk` tokens, in the hidden dtype with fp32 accumulation.
    """
    B, T, D = hidden.shape
    n = B * T
    h = hidden.reshape(n, D)
    tg = targets.reshape(n).astype(jnp.int32)
    m = loss_mask.reshape(n).astype(jnp.float32)
    chunk = min(chunk, n)
    pad = -n % chunk
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        tg = jnp.pad(tg, (0, pad))
        m = jnp.pad(m, (0, pad))
    w = head_w.astype(hidden.dtype)

    def body(total, xs):
        return total + _chunk_ce(*xs, w), None

    k = (n + pad) // chunk
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (h.reshape(k, chunk, D), tg.reshape(k, chunk), m.reshape(k, chunk)))
    return total, jnp.sum(m)


@jax.custom_vjp
def _chunk_ce(h, t, m, w):
    """Sum of CE over one chunk: h [C, D], targets/mask [C], w [D, V] (h and w in the compute dtype)."""
    logits = jnp.einsum("cd,dv->cv", h, w, preferred_element_type=jnp.float32)  # [C, V] fp32
    return cross_entropy_sum(logits, t, m)[0]


def _chunk_ce_fwd(h, t, m, w):
    logits = jnp.einsum("cd,dv->cv", h, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [C]
    target_logit = jnp.take_along_axis(logits, t[:, None].astype(jnp.int32), axis=-1)[:, 0]
    mask = m.astype(jnp.float32)
    return jnp.sum((lse - target_logit) * mask), (h, t, m, w, lse)


def _chunk_ce_bwd(res, g):
    """Recompute the chunk's logits; d logits = (softmax - onehot) * mask * g, cast to the compute dtype so
    both backward GEMMs run in it (bf16 on GPU; fp32 stays fp32, exact)."""
    h, t, m, w, lse = res
    logits = jnp.einsum("cd,dv->cv", h, w, preferred_element_type=jnp.float32)
    p = jnp.exp(logits - lse[:, None])
    p = p.at[jnp.arange(p.shape[0]), t.astype(jnp.int32)].add(-1.0)
    d_logits = (p * (m.astype(jnp.float32) * g)[:, None]).astype(h.dtype)  # [C, V]
    dh = jnp.einsum("cv,dv->cd", d_logits, w).astype(h.dtype)
    dw = jnp.einsum("cd,cv->dv", h, d_logits).astype(w.dtype)
    return dh, None, None, dw


_chunk_ce.defvjp(_chunk_ce_fwd, _chunk_ce_bwd)


def lm_loss(model, batch: dict, *, chunk: int = DEFAULT_CHUNK_TOKENS, remat=None,
            unroll: int | bool = 1) -> tuple[jax.Array, dict]:
    """The causal-LM loss of a `Decoder` on a packed batch (see surojax/data/batch.py).

    Returns (sum of CE over supervised tokens, {"tokens": count}); divide by the accumulated count.
    `remat` / `unroll`: the layer loop's recompute wrapper and scan unrolling (Decoder.hidden_states).
    """
    h, _ = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"], remat=remat,
                               unroll=unroll)
    total, count = chunked_lm_loss(h, model.head_weight(), batch["targets"], batch["loss_mask"], chunk)
    return total, {"tokens": count}
