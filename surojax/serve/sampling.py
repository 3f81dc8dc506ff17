"""Next-token sampling from fp32 logits: greedy, temperature, top-k, top-p, min-p.

All functions take logits [B, V] and return token ids [B]. Temperature 0 means greedy (argmax), which is
what every parity and "batching never changes a result" check relies on.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> jax.Array:
    """Mask (to -inf) the tokens that top-k / top-p / min-p exclude. logits [B, V] fp32."""
    neg = jnp.finfo(logits.dtype).min
    if top_k and top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if min_p > 0.0:
        probs = jax.nn.softmax(logits, axis=-1)
        logits = jnp.where(probs < min_p * probs.max(axis=-1, keepdims=True), neg, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep a token when the mass before it is < top_p (so the most likely token always stays)
        keep_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return logits


def sample(logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> jax.Array:
    """logits [B, V] -> ids [B] (int32)."""
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits / temperature, top_k, top_p, min_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
