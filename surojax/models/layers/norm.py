"""RMSNorm as Llama / Qwen / Mistral compute it: statistics in fp32, scale applied in the input dtype.

Zero-centred (Qwen3.5, `ModelConfig.norm_zero_centered`): the scale is (1 + w) with w initialised to zeros, applied in
fp32 before the cast back (transformers' Qwen3_5RMSNorm). Gated (Qwen3.5's DeltaNet output, `gated_rms_norm`):
normalised, scaled by w in the input dtype, then times silu(gate) in fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.params import param


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D]; normalised in fp32, cast back, then scaled."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def rms_norm_unscaled(x: jax.Array, eps: float) -> jax.Array:
    """x [..., D] * rsqrt(mean(x^2) + eps) in fp32, cast back: Gemma 4's v norm (an RMSNorm without a weight)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rms_norm_zero_centered(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [..., D] * rsqrt(mean(x^2) + eps) * (1 + w [D]), all in fp32, cast back at the end."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """rms_norm(x) * silu(gate): x, gate [..., D], scale [D]; the gate applied in fp32, cast back to x's dtype."""
    y = rms_norm(x, scale, eps).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str, *, param_dtype, rngs: nnx.Rngs | None = None,
                 zero_centered: bool = False):
        self.eps = eps
        self.zero_centered = zero_centered
        self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init="zeros" if zero_centered else "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.zero_centered:
            return rms_norm_zero_centered(x, self.scale[...], self.eps)
        return rms_norm(x, self.scale[...], self.eps)
