"""The definition of paged decode attention in pure jnp: what `kernel.py` computes, gathered and dense.

    q [B, N, H] (N = K * G), pools k/v [L, NBLK * bs, K, H], layer [] int32, block_table [B, NB],
    lengths [B] -> out [B, N, H]

Token p of row b lives in slot ``block_table[b, p // bs] * bs + p % bs`` of layer `layer`'s pool; row b
attends to its positions < lengths[b]. Softmax in fp32, scale H ** -0.5, no sliding window; a row of length 0
gets zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a score that softmax sends to 0 without inf - inf = NaN


def paged_decode_reference(q, k_pool, v_pool, layer, block_table, lengths, *, block_size: int):
    """The definition: gather every row's blocks of `layer`, mask positions >= lengths, softmax in fp32."""
    B, N, H = q.shape
    L, NS, K, _ = k_pool.shape
    NB = block_table.shape[1]
    S = NB * block_size
    slots = (block_table[:, :, None] * block_size + jnp.arange(block_size)[None, None, :]).reshape(B, S)
    k = k_pool[layer][slots].astype(jnp.float32)  # [B, S, K, H]
    v = v_pool[layer][slots].astype(jnp.float32)
    qg = q.reshape(B, K, N // K, H).astype(jnp.float32)
    scores = jnp.einsum("bkgh,bskh->bkgs", qg, k) * H ** -0.5
    valid = jnp.arange(S)[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.where(valid[:, None, None, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1) * jnp.any(valid, axis=1)[:, None, None, None]
    return jnp.einsum("bkgs,bskh->bkgh", probs, v).reshape(B, N, H).astype(q.dtype)

__all__ = ["MASKED", "paged_decode_reference"]
