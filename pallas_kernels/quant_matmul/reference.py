"""The pure-jnp references of the fused kernels: decode the whole KernelLayout as the kernels decode a tile
(`dequantize_layout`), then one jnp.dot with float32 accumulation, the result cast like the kernel's.

The tests tie this chain to each format's own `dequantize`: `dequantize_layout(w.kernel_layout(kt))` equals
`w.dequantize(float32)` bit for bit, and the kernels are checked against `x @ w.dequantize(x.dtype)`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul.layout import KernelLayout


def dequantize_layout(lw: KernelLayout) -> jax.Array:
    """KernelLayout -> float32 [K, N]: w = decode(code) * scale (- offset), per value."""
    k, n = lw.shape
    spec = lw.spec
    codes = lw.codes
    if spec.nibble:
        c = codes.reshape(k // lw.kt, 1, lw.kt // 2, n)
        codes = jnp.concatenate([c & 0x0F, c >> 4], axis=1).reshape(k, n)
    if not spec.group:                                  # plain_layout: the codes are the values
        return spec.decode(codes)
    rows = lambda a: jnp.repeat(a, spec.group, axis=0)  # noqa: E731  [K/G, N] -> [K, N]
    w = spec.decode(codes) * rows(lw.scale)
    if spec.has_offset:
        w = w - rows(lw.offset)
    return w


def forward_ref(x: jax.Array, lw: KernelLayout, out_dtype=None) -> jax.Array:
    """y [M, N] = x [M, K] @ W (decoded, cast to x's dtype), fp32 accumulation."""
    y = jnp.dot(x, dequantize_layout(lw).astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def transposed_ref(g: jax.Array, lw: KernelLayout, out_dtype=None) -> jax.Array:
    """dx [M, K] = g [M, N] @ W^T (decoded, cast to g's dtype), fp32 accumulation."""
    dx = jnp.dot(g, dequantize_layout(lw).astype(g.dtype).T, preferred_element_type=jnp.float32)
    return dx.astype(out_dtype or g.dtype)


__all__ = ["dequantize_layout", "forward_ref", "transposed_ref"]
