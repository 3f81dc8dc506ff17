"""Gated MLP: down(act(gate(x)) * up(x)): SwiGLU (act = silu) or Gemma's GeGLU (act = gelu_pytorch_tanh, the
tanh-approximated GELU, in the input dtype as torch computes it). Kernels gate/up [D, F], down [F, D]; or gate_up
[D, 2F] (gate columns first) when surojax.models.fused_projections has joined them for serving; a joined weight
that offers `gated_matmul` (surojax.quant.gemv_weight.GemvWeight: the decode GEMV) computes act(gate) * up in its
kernel's epilogue at decode."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear


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

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        if self.gate_up_proj is not None:
            w = self.gate_up_proj.kernel[...]
            if hasattr(w, "gated_matmul") and self.gate_up_proj.bias is None:  # the decode GEMV's fused product
                act = w.gated_matmul(x, self.activation)                         # (None where it does not apply)
                if act is not None:
                    return self.down_proj(act)
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)
