"""The pure-jnp reference of the decode prologue (kernel.py): what an attention layer computes between its joined QKV
GEMV and the paged decode attention at T == 1, the decoder's own operations in their order and dtypes
(surojax/models/layers/attention.py, norm.py, rope.py; kv/paged.py's `PagedLayerKV.write`):

    q, k, v = split(qkv)                     [B, N H], [B, K H], [B, K H]
    q = rms_norm(q) per head (q_norm)        optional: fp32 statistics; plain  w.astype(dt) * normed.astype(dt)
    k = rms_norm(k) per head (k_norm)                                  zero_centered (normed * (1 + w)) in fp32, to dt
    q, k = rope(q), rope(k)                  x * cos + rotate_half(x) * sin, in dt (HF's non-interleaved rope)
    pool_k[layer, slot_b] = k_b, pool_v[layer, slot_b] = v_b     a slot >= S is padding: nothing written

dt is qkv's dtype (the compute dtype; the pools hold it too). Every kernel output is checked against this
(tests/pallas_kernels/test_decode_prologue.py), and this against the decoder's own functions."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_gemv.reference import rms_norm_ref


def rope_ref(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, N, H], cos / sin [B, H] -> [B, N, H]: x * cos + rotate_half(x) * sin, each op in x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def decode_prologue_ref(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                        layer: jax.Array | int, slots: jax.Array, *, num_heads: int, num_kv_heads: int,
                        q_norm_weight: jax.Array | None = None, k_norm_weight: jax.Array | None = None,
                        zero_centered: bool = False, eps: float = 1e-6
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [B, (N + 2K) H]; cos / sin [B, H]; pools [L, S, K, H]; slots [B] -> (q [B, N, H], k_pool, v_pool)
    (module docstring)."""
    B = qkv.shape[0]
    N, K, H = num_heads, num_kv_heads, k_pool.shape[-1]
    q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
    q, k, v = q.reshape(B, N, H), k.reshape(B, K, H), v.reshape(B, K, H)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps, zero_centered)
    if k_norm_weight is not None:
        k = rms_norm_ref(k, k_norm_weight, eps, zero_centered)
    q, k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
    k_pool = k_pool.at[layer, slots].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer, slots].set(v.astype(v_pool.dtype), mode="drop")
    return q, k_pool, v_pool


__all__ = ["decode_prologue_ref", "rope_ref"]
