"""LayerNorm as torch's nn.LayerNorm computes it (the vision tower's norms): mean and variance over the last axis in
fp32, (x - mean) * rsqrt(var + eps) * weight + bias, cast back to the input dtype. Scale and bias are `scale` /
`bias` here, `weight` / `bias` in transformers' names."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.params import param


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axes: tuple[str | None], *, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = param(None, (dim,), axes, param_dtype, init="ones")
        self.bias = param(None, (dim,), axes, param_dtype, init="zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)
