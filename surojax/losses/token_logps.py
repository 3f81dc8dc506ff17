"""Per-token log-probabilities of the targets under the LM head, chunked over the tokens: the one implementation
that DPO (sequence log-probs), GRPO (policy, old and reference log-probs) and their reference passes share.

    logps = target_logps(hidden, head_w, targets, temperature=0.7)     # [N, T] fp32
    logps = model_target_logps(model, batch, temperature=0.7)          # the decoder's hidden states first

log p(target) = log_softmax(logits / temperature)[target], in fp32. The N*T tokens are walked in chunks of `chunk`
with the LM loss's pieces (surojax.losses.lm: `token_chunks`, `chunk_logits`): logits [C, V] fp32 from
compute-dtype operands, one chunk at a time, never [N, T, V]. Unlike the CE sum, whose upstream cotangent is a
scalar known in the forward (so lm.py computes its gradients there), a per-token output takes a cotangent [N, T]
only known in the backward pass, so each chunk is rematerialised there (jax.checkpoint): at most one chunk's
logits exist at a time, forward or backward, for one more head GEMM per chunk.

Shapes: N rows, T positions, D hidden, V vocabulary, C tokens per chunk (surojax/models/config.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from surojax.losses.lm import DEFAULT_CHUNK_TOKENS, chunk_logits, soft_cap, token_chunks


def target_logps(hidden: jax.Array, head_w: jax.Array, targets: jax.Array, *, temperature: float = 1.0,
                 chunk: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None) -> jax.Array:
    """hidden [N, T, D] (final-normed, compute dtype), head_w [D, V], targets [N, T] -> log p(target) [N, T] fp32
    of log_softmax(logits / temperature), the logits soft-capped first when `softcap` is set. Differentiable in
    hidden and head_w (chunks recomputed backward)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    N, T, D = hidden.shape
    n = N * T
    h, tg = token_chunks(chunk, hidden.reshape(n, D), targets.reshape(n).astype(jnp.int32))  # [k, C, D], [k, C]
    w = head_w.astype(hidden.dtype)

    @jax.checkpoint
    def chunk_logps(hc, tc):  # [C, D], [C] -> [C]
        logits = soft_cap(chunk_logits(hc, w), softcap)  # [C, V] fp32
        if temperature != 1.0:
            logits = logits / temperature
        target = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        return target - jax.nn.logsumexp(logits, axis=-1)

    def body(_, xs):
        return None, chunk_logps(*xs)

    _, out = jax.lax.scan(body, None, (h, tg))  # [k, C]
    return out.reshape(-1)[:n].reshape(N, T)


def model_target_logps(model, batch: dict, *, temperature: float = 1.0,
                       chunk: int = DEFAULT_CHUNK_TOKENS) -> jax.Array:
    """`target_logps` of a `Decoder` on rows: batch tokens / positions / segment_ids / targets [N, T] -> [N, T]
    fp32 (the layers run on the decoder's layer runner)."""
    h = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"]).hidden  # [N, T, D]
    return target_logps(h, model.head_weight(), batch["targets"], temperature=temperature, chunk=chunk,
                        softcap=model.cfg.final_logit_softcapping)
