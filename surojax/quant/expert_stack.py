"""ExpertStack: a layer stack of plain (bf16 / fp32) expert weights [L, E, I, O] that the decoder's layer scan hands
over whole with the layer index, for the gathered GEMV kernel (pallas_kernels/gathered_gemv) to read each routed
expert of that layer in place.

Why. The scan slices every other leaf of a layer stack per layer; a slice that feeds a Pallas custom call is
copied out of the stack first: at Qwen3-30B-A3B shapes all 128 experts of the layer (gate_up 805 MB + down 403 MB
in bf16) per layer and decode token, where the kernel reads 8 experts' 75 MB. An XLA gather instead fuses the
slice into its indexing, so only the kernel needs this. A served model converts its expert stacks once at load
(surojax.quant.laid_out.experts_in_place, called by its decode_weights when SUROJAX_MOE_GATHER_KERNEL resolves to the
kernel: pallas_kernels.gathered_gemv.api.converts).

    data    [L, E, I, O]   the experts' kernels as loaded (ExpertLinear's [E, in, out] per layer)
    layer   None, or an int32 scalar: this is layer `layer` of the stack (`at_layer`, layer_runner.split_in_place)
    shape   (I, O), source (the dtype's name)            static

ExpertLinear.gathered calls `gathered` (`experts_in_place`: the kernel or XLA's gather from the stack at
layer x E + id); the grouped GEMM (prefill, more rows) takes the layer's [E, I, O] slice
(`grouped_matmul`), as it does from a plain stack. Serving only: the values are the plain stack's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_dot
from pallas_kernels.grouped_matmul.gathered import gathered_dot
from surojax.quant.base import QuantFormat


@dataclasses.dataclass(frozen=True)
class ExpertStack(QuantFormat):
    data: jax.Array
    layer: jax.Array | None
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    source: str = dataclasses.field(metadata={"static": True})

    stacked_in_place = True   # the decoder's layer scan hands over the whole stack and the index (at_layer)
    experts_in_place = True   # ExpertLinear.gathered calls `gathered`
    name = "experts_in_place"  # not in FORMATS: made from a loaded plain expert stack, never quantised
    quantised = False
    packed_ndim = 3

    @classmethod
    def from_kernel(cls, w: jax.Array) -> "ExpertStack":
        if w.ndim != 4 or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"ExpertStack: a plain float expert stack [L, E, I, O] expected, got {w.shape} {w.dtype}")
        return cls(data=w, layer=None, shape=tuple(w.shape[-2:]), source=jnp.dtype(w.dtype).name)

    @classmethod
    def bytes_per_value(cls) -> float:
        raise NotImplementedError("experts_in_place keeps its source dtype: see data.dtype")

    def at_layer(self, index: jax.Array) -> "ExpertStack":
        if self.layer is not None:
            raise ValueError(f"experts_in_place ({self.source}): at_layer on one layer already, data "
                             f"{self.data.shape}")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def _own(self) -> jax.Array:
        """This layer's experts [E, I, O] (the whole data when no layer is set: [L, E, I, O])."""
        if self.layer is None:
            return self.data
        return jax.lax.dynamic_index_in_dim(self.data, self.layer, 0, keepdims=False)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return self._own().astype(dtype)

    def gathered(self, x: jax.Array, expert_ids: jax.Array, mode: str = "auto") -> jax.Array:
        """x [A, I], expert_ids [A] -> [A, O]: row a against this layer's expert expert_ids[a], read in place
        (pallas_kernels.grouped_matmul.gathered_dot with the layer index; `mode` picks the kernel or XLA)."""
        return gathered_dot(x, self.data, expert_ids, layer=self.layer, kernel=mode)

    def grouped_matmul(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return grouped_dot(x, self._own(), group_sizes)

    def take_experts(self, ids: jax.Array) -> "QuantFormat":
        raise ValueError("experts_in_place: the gathered form reads data and layer in place (`gathered`), not "
                         "take_experts")

    def __repr__(self) -> str:
        return f"ExpertStack({self.source}, data={list(self.data.shape)})"


jax.tree_util.register_dataclass(ExpertStack, data_fields=["data", "layer"], meta_fields=["shape", "source"])


__all__ = ["ExpertStack"]
