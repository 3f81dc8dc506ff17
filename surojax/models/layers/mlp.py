"""SwiGLU MLP: down(silu(gate(x)) * up(x)). Kernels gate/up [D, F], down [F, D]."""
from __future__ import annotations

import jax
from flax import nnx

from surojax.models.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, param_dtype, rngs: nnx.Rngs | None = None):
        self.gate_proj = Linear(dim, hidden, ("embed", "mlp"), param_dtype=param_dtype, rngs=rngs)
        self.up_proj = Linear(dim, hidden, ("embed", "mlp"), param_dtype=param_dtype, rngs=rngs)
        self.down_proj = Linear(hidden, dim, ("mlp", "embed"), param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
