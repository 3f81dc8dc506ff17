"""RMSNorm as Llama / Qwen / Mistral compute it: statistics in fp32, scale applied in the input dtype."""
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


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str, *, param_dtype, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)
