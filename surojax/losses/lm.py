"""Language-modelling loss as pure functions of (hidden states or logits, batch) -> (loss sum, token count).

The loss of a step is the mean over the supervised tokens of the WHOLE accumulated batch, so these return
sums and counts, and the trainer divides once at the end (an average of micro-batch means would weight
tokens of short micro-batches more).

`chunked_lm_loss` never materialises fp32 logits [B, T, V] for the whole batch: it walks the flattened
tokens in chunks of `chunk` rows, computing logits [C, V] -> logsumexp - target logit per chunk under
`jax.checkpoint`, so the backward pass recomputes each chunk's logits instead of storing them. Memory is
O(C * V) instead of O(B * T * V) (151,936 * 4 bytes per token for Qwen3: 0.6 MB a token).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [..., V] (any float dtype, computed in fp32), targets/loss_mask [...] -> (sum of CE, count)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum((lse - target_logit) * mask), jnp.sum(mask)


def chunked_lm_loss(hidden: jax.Array, head_w: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                    chunk: int = 4096) -> tuple[jax.Array, jax.Array]:
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

    @jax.checkpoint
    def one_chunk(h_c, t_c, m_c):
        logits = jnp.einsum("cd,dv->cv", h_c, w, preferred_element_type=jnp.float32)  # [C, V]
        return cross_entropy_sum(logits, t_c, m_c)[0]

    def body(total, xs):
        return total + one_chunk(*xs), None

    k = (n + pad) // chunk
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (h.reshape(k, chunk, D), tg.reshape(k, chunk), m.reshape(k, chunk)))
    return total, jnp.sum(m)


def lm_loss(model, batch: dict, *, chunk: int = 4096, remat=None) -> tuple[jax.Array, dict]:
    """The causal-LM loss of a `Decoder` on a packed batch (see surojax/data/batch.py).

    Returns (sum of CE over supervised tokens, {"tokens": count}); divide by the accumulated count.
    """
    h, _ = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"], remat=remat)
    total, count = chunked_lm_loss(h, model.head_weight(), batch["targets"], batch["loss_mask"], chunk)
    return total, {"tokens": count}
