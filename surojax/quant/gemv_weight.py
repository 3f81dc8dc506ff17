"""GemvWeight: a plain (bf16 / fp16 / fp32) Linear kernel stored transposed, [..., N, K], for the decode GEMV.

A decode step multiplies a few rows (one token per running sequence) by every weight: the product is bound by
the weight's bytes. XLA runs such a GEMV as a multiply fusion and a reduce fusion over the [K, N] kernel, ~0.6 TB/s
on an H100 (benchmarks/RESULTS.md "Where a decode step's time goes"); the Pallas kernel
(pallas_kernels/decode_gemv) reads the weight as contiguous K rows of [N, K], each output column's values in one
run, in one launch. A served model converts its layer stack's plain Linear kernels once at load
(`surojax.quant.laid_out.transpose_for_gemv`, called by `decode_weights` when SUROJAX_DECODE_GEMV resolves to the
kernel: `pallas_kernels.decode_gemv.api.converts`).

    data    [..., N, K]   the kernel, transposed (leading axes: the stacked layers)
    layer   None, or an int32 scalar: data is the whole stack [L, N, K] and this is layer `layer`, read in place
            (`at_layer`: the decoder's layer scan hands the stack and the index, Decoder.split_in_place)
    shape   (K, N), source (the dtype's name)        static

`matmul(x)` takes the kernel for the calls of few rows the setting gives it (pallas_kernels.decode_gemv.api.choose:
M <= 8 through its FMA body, up to 64 through its tensor-core body, which auto takes once measured), and XLA's
einsum on the transposed weight otherwise (prefill, more rows: cuBLAS reads either orientation; a stacked weight's
layer is sliced out there, as LaidOut's XLA path does: XLA copies it out of the stack first).
`fused_matmul(x, norm_weight=, activation=, residual=)`: the same product with the kernel's RMSNorm prologue, a
joined gate/up weight's act(gate) * up and the residual add (surojax.models.layers.linear.fused_linear: the
decoder's blocks ask for them at decode). The values are the kernel's, bit for bit (`dequantize` transposes back). Serving only: the kernel has no gradient.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_gemv.api import choose, decode_gemv, weight_error
from surojax.kernel_settings import kernel_settings
from surojax.quant.base import QuantFormat
from surojax.models.layers.stacked_vector import in_place

KERNEL_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # hidden_act -> kernel's


@dataclasses.dataclass(frozen=True)
class GemvWeight(QuantFormat):
    data: jax.Array
    layer: jax.Array | None
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    source: str = dataclasses.field(metadata={"static": True})

    stacked_in_place = True  # the decoder's layer scan hands over the whole stack and the index (at_layer)
    name = "gemv_t"          # not in FORMATS: made from a loaded plain kernel (transposed), never quantised
    quantised = False

    @classmethod
    def from_kernel(cls, w: jax.Array) -> "GemvWeight":
        """A plain kernel [..., K, N] -> its transpose (one pass over its bytes)."""
        return cls(data=jnp.swapaxes(w, -1, -2), layer=None, shape=tuple(w.shape[-2:]), source=jnp.dtype(w.dtype).name)

    @classmethod
    def bytes_per_value(cls) -> float:
        raise NotImplementedError("gemv_t keeps its source dtype: see data.dtype")

    def at_layer(self, index: jax.Array) -> "GemvWeight":
        if self.data.ndim != 3 or self.layer is not None:
            raise ValueError(f"gemv_t ({self.source}): at_layer needs one stacked layers axis, data "
                             f"{self.data.shape}, layer {self.layer}")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def join_columns(self, parts: list) -> "GemvWeight | None":
        """parts (this first) side by side along N (rows of the transposed data); None when they differ."""
        key = lambda p: (p.source, p.shape[0], p.layer is None, p.data.shape[:-2])  # noqa: E731
        if not all(isinstance(p, GemvWeight) and key(p) == key(self) for p in parts) or self.layer is not None:
            return None
        return dataclasses.replace(self, data=jnp.concatenate([p.data for p in parts], axis=-2),
                                   shape=(self.shape[0], sum(p.shape[1] for p in parts)))

    def _own(self) -> jax.Array:
        """This weight's [..., N, K]: layer `layer` sliced out of the stack when it is set."""
        if self.layer is None:
            return self.data
        return jax.lax.dynamic_index_in_dim(self.data, self.layer, 0, keepdims=False)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return jnp.swapaxes(self._own(), -1, -2).astype(dtype)

    def _kernel_takes(self, x: jax.Array, gated: bool = False) -> bool:
        one_layer = self.data.ndim - (self.layer is not None) == 2
        m = int(np.prod(x.shape[:-1]))
        return (one_layer and choose(m, kernel_settings().decode_gemv.value) == "pallas"
                and weight_error(self.shape[1], self.shape[0], gated, m) is None)

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ W -> [..., N] in x's dtype (module docstring)."""
        if self._kernel_takes(x):
            return decode_gemv(x, self.data, layer=self.layer)
        return jnp.einsum("...k,nk->...n", x, self._own().astype(x.dtype))

    def fused_matmul(self, x: jax.Array, *, norm_weight=None, eps: float = 1e-6,
                     zero_centered: bool = False, activation: str | None = None,
                     residual: jax.Array | None = None) -> jax.Array | None:
        """The decode GEMV with what it fuses, or None where the kernel does not take this call (the caller runs
        the ops itself): RMSNorm(x) with norm_weight first (zero_centered: Gemma's (1 + w)), act(gate) * up of a
        joined [gate | up] weight (`activation`: the config's hidden_act), residual + the result last. norm_weight:
        [K], or a StackedVector at a layer (surojax.models.layers.stacked_vector: the kernel reads its row in place)."""
        act = None if activation is None else KERNEL_ACTIVATIONS.get(activation)
        if (activation is not None and act is None) or not self._kernel_takes(x, gated=act is not None):
            return None
        norm = None if norm_weight is None else ("zero_centered" if zero_centered else "plain")
        norm_weight, norm_layer = (None, None) if norm_weight is None else in_place(norm_weight)
        return decode_gemv(x, self.data, layer=self.layer, norm_weight=norm_weight, norm_layer=norm_layer, norm=norm,
                           eps=eps, activation=act, residual=residual)

    def __repr__(self) -> str:
        return f"GemvWeight({self.source}, data={list(self.data.shape)})"


jax.tree_util.register_dataclass(GemvWeight, data_fields=["data", "layer"], meta_fields=["shape", "source"])

__all__ = ["GemvWeight", "KERNEL_ACTIVATIONS"]
