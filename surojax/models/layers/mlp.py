"""Gated MLP: down(act(gate(x)) * up(x)): SwiGLU (act = silu) or Gemma's GeGLU (act = gelu_pytorch_tanh, the
tanh-approximated GELU, in the input dtype as torch computes it). Kernels gate/up [D, F], down [F, D]; or gate_up
[D, 2F] (gate columns first) when surojax.models.fused_projections has joined them for serving. The block's RMSNorm
and residual add may be handed in (`norm`, `residual`): at decode, a weight laid out for the decode GEMV
(surojax.quant.gemv_weight) runs the norm in gate_up's prologue, act(gate) * up in its epilogue and the residual add
in down's epilogue: two kernels for the whole MLP half of a block."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear, fused_linear


ACTIVATIONS = {"silu": jax.nn.silu, "swish": jax.nn.silu,
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, param_dtype, rngs: nnx.Rngs | None = None,
                 activation: str = "silu"):
        self.activation = activation  # static: a key of ACTIVATIONS (ModelConfig.hidden_act)
        self.gate_proj = Linear(dim, hidden, ("embed", "mlp"), param_dtype=param_dtype, rngs=rngs)
        self.up_proj = Linear(dim, hidden, ("embed", "mlp"), param_dtype=param_dtype, rngs=rngs)
        self.down_proj = Linear(hidden, dim, ("mlp", "embed"), param_dtype=param_dtype, rngs=rngs)
        self.gate_up_proj: Linear | None = nnx.data(None)  # gate and up in one GEMM (fused_projections)

    def __call__(self, x: jax.Array, norm=None, residual: jax.Array | None = None) -> jax.Array:
        """[B, T, D] -> [B, T, D]. norm (an RMSNorm): x is normalised first; residual: residual + the MLP's output.
        Both in the decode GEMV's prologue / epilogue where the kernels take the call (linear.fused_linear: the
        joined gate/up with its gated product, the down projection with the residual), as ops otherwise."""
        act = None
        if self.gate_up_proj is not None:
            act = fused_linear(self.gate_up_proj, x, norm=norm, activation=self.activation)
        if act is None:
            if norm is not None:
                x = norm(x)
            if self.gate_up_proj is not None:
                gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            act = ACTIVATIONS[self.activation](gate) * up
        y = None if residual is None else fused_linear(self.down_proj, act, residual=residual)
        if y is None:
            y = self.down_proj(act)
            y = y if residual is None else residual + y
        return y
