"""The pure-jnp references of the fused kernels: dequantise with the format's own `dequantize` (independent of
the kernel layout), then one jnp.dot with float32 accumulation, the result cast like the kernel's."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def forward_ref(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """y [M, N] = x [M, K] @ w.dequantize(x.dtype) [K, N], fp32 accumulation."""
    y = jnp.dot(x, w.dequantize(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def transposed_ref(g: jax.Array, w, out_dtype=None) -> jax.Array:
    """dx [M, K] = g [M, N] @ w.dequantize(g.dtype)^T, fp32 accumulation."""
    dx = jnp.dot(g, w.dequantize(g.dtype).T, preferred_element_type=jnp.float32)
    return dx.astype(out_dtype or g.dtype)


__all__ = ["forward_ref", "transposed_ref"]
