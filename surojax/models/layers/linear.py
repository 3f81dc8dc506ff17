"""Linear layers. Kernels are stored [in, out] (`x @ W`-ready) with their logical axes.

`dot(x, w)` is the one matmul entry point: a plain array is multiplied by XLA; a quantised weight (any
pytree with a `matmul` method, see surojax.quant) dispatches to its own kernel. LoRA, quantisation and
offload replace or wrap these modules from outside the model code. `fused_linear` is the decode path's variant: the
product with the RMSNorm before it and the gated product / residual after it, where the weight's kernel fuses them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.params import param


def dot(x: jax.Array, w) -> jax.Array:
    """x [..., I] @ w [I, O] -> [..., O] in x's dtype.

    The GEMM accumulates in fp32 inside cuBLAS either way; asking for an fp32 result and casting back would
    make the backward pass run fp32 (tf32) GEMMs on fp32 cotangents, slower than compute-dtype GEMMs (a profile
    of the LoRA step: benchmarks/RESULTS.md#s2-profile). Operands and result stay in the compute dtype, so does the backward.
    """
    if hasattr(w, "matmul"):
        return w.matmul(x)
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, axes: tuple[str, str], *, use_bias: bool = False,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = param(rngs, (in_features, out_features), axes, param_dtype)
        self.bias = param(rngs, (out_features,), axes[1:], param_dtype, init="zeros") if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = dot(x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


def fused_linear(lin, x: jax.Array, *, norm=None, activation: str | None = None,
                 residual: jax.Array | None = None) -> jax.Array | None:
    """lin(norm(x)), or act(gate) * up of a joined [gate | up] lin (`activation`: a hidden_act name), plus
    `residual`, computed by one kernel where lin's kernel offers `fused_matmul` (the decode GEMV's GemvWeight,
    surojax.quant.gemv_weight, at a decode call) -> the result, or None: the caller runs the ops itself.
    norm: an RMSNorm-like module (scale, eps, zero_centered) or None. A plain Linear without bias only."""
    if type(lin) is not Linear or lin.bias is not None:
        return None
    fused = getattr(lin.kernel[...], "fused_matmul", None)
    if fused is None:
        return None
    # the scale as it is stored (a StackedVector is read in place by the kernel; `scale[...]` would slice it out)
    kw = {} if norm is None else dict(norm_weight=norm.scale.get_value(), eps=norm.eps,
                                      zero_centered=norm.zero_centered)
    return fused(x, activation=activation, residual=residual, **kw)
