"""Parameters with logical axis names.

Every parameter is an `nnx.Param` whose metadata `axes` names each dimension with a logical axis
(`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `layers`, ...). `surojax.parallel` maps these
names to mesh axes through one rules table; model code never names a mesh axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

AXES = "axes"  # metadata key on every Param


def param(rngs: nnx.Rngs | None, shape, axes: tuple[str | None, ...], dtype, init: str = "normal",
          std: float = 0.02) -> nnx.Param:
    """A parameter of `shape`, initialised `normal` (std), `ones` or `zeros`, tagged with its logical axes."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, **{AXES: tuple(axes)})


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The variable's logical axis names (None for each dimension of a variable that has none)."""
    meta = variable.get_metadata()
    if AXES in meta:
        return tuple(meta[AXES])
    return (None,) * variable.get_value().ndim
