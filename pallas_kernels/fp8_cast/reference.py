"""The pure-jnp meaning of `cast_transpose`: three XLA passes (quantise, transpose, amax) where the kernel makes one."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def quantize(x: jax.Array, inv: jax.Array, dtype, bound: float) -> jax.Array:
    """saturate(rne(x * inv)) in `dtype`, computed in fp32 (inv: the fp32 scale 1 / d, a scalar)."""
    return jnp.clip(x.astype(jnp.float32) * inv, -bound, bound).astype(dtype)


def cast_transpose_reference(x: jax.Array, inv: jax.Array, dtype, bound: float):
    """x [R, C] -> (q [R, C], q^T [C, R]) in the FP8 `dtype`, and amax = max |x| (fp32 scalar)."""
    q = quantize(x, jnp.asarray(inv, jnp.float32), dtype, bound)
    return q, q.T, jnp.max(jnp.abs(x)).astype(jnp.float32)


__all__ = ["quantize", "cast_transpose_reference"]
