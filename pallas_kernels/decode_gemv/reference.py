"""The pure-jnp reference of the decode GEMV (kernel.py): the decoder's own operations, in the order and dtypes the
model layers compute them (surojax/models/layers/norm.py, mlp.py, the residual add of decoder.Block):

    xn = rms_norm(x)            optional: fp32 statistics; plain  scale.astype(dt) * normed.astype(dt)
                                                          Gemma's (normed * (1 + w)) in fp32, cast to dt
    y  = xn @ W^T               W stored [N, K]; fp32 accumulation, cast to dt
    y  = act(y[:, :F]) * y[:, F:]   optional (a joined gate/up weight, N = 2F): silu (SwiGLU) or tanh-GELU (GeGLU)
    y  = y + r                  optional residual, in dt

dt is x's dtype. Every kernel output is checked against this (tests/pallas_kernels/test_decode_gemv.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}


def rms_norm_ref(x: jax.Array, w: jax.Array, eps: float, zero_centered: bool) -> jax.Array:
    """x [M, K], w [K] -> [M, K] in x's dtype, as surojax.models.layers.norm computes it."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w.astype(x.dtype) * normed.astype(x.dtype)


def decode_gemv_ref(x: jax.Array, wt: jax.Array, *, norm: jax.Array | None = None, eps: float = 1e-6,
                    zero_centered: bool = False, activation: str | None = None,
                    residual: jax.Array | None = None) -> jax.Array:
    """x [M, K], wt [N, K] -> [M, N] (or [M, N/2] with an activation) in x's dtype (module docstring)."""
    if norm is not None:
        x = rms_norm_ref(x, norm, eps, zero_centered)
    y = jnp.einsum("mk,nk->mn", x, wt.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    if activation is not None:
        gate, up = jnp.split(y, 2, axis=-1)
        y = ACTIVATIONS[activation](gate) * up
    if residual is not None:
        y = y + residual.astype(y.dtype)
    return y


__all__ = ["ACTIVATIONS", "decode_gemv_ref", "rms_norm_ref"]
