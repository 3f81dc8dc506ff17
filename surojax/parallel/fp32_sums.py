"""Sums over devices inside a `jax.shard_map` taken in fp32 when the values are 16-bit floats.

    vary(x, axes)   x marked varying over `axes` (those it is not varying over yet); the transpose of that cast is
                    the sum of x's cotangent over those devices, taken here in fp32 (x is cast up before the cast
                    and back after it)
    psum(x, axes)   jax.lax.psum in fp32, the result in x's dtype

Why: a gradient summed over devices in bf16 loses bits the one-device program keeps (it sums fp32 gradients of
fp32 parameters), and XLA CPU aborts compiling a bf16 all-reduce of a partially manual shard_map ("Invalid binary
instruction opcode copy": AllReducePromotion clones a reducer that ends in a sharding annotation). Used by the
pipeline's stage boundary (pipeline.py) and the expert exchange (expert.py). Other dtypes pass through unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _narrow(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4


def vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """x varying over every one of `axes`; its cotangent's sum over them (the transpose) in fp32."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    if not missing:
        return x
    if not _narrow(x):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)


def psum(x: jax.Array, axes) -> jax.Array:
    """The sum of x over `axes`, added in fp32 when x is a 16-bit float; the result in x's dtype."""
    if not _narrow(x):
        return jax.lax.psum(x, axes)
    return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


__all__ = ["vary", "psum"]
