"""StackedVector: a per-layer vector parameter of a layer stack (an RMSNorm's scale [L, D]) that the decoder's layer
scan hands over whole, with the layer's index, instead of slicing it out.

At a decode step the layer scan slices every stacked parameter per layer. A slice of a small vector is a copy of a
few KB, yet each is its own device operation: on an H100, one user of Qwen3-0.6B shapes spent 235 us of every
token's 2.2 ms in 140 such copies (`memcpy32_post`: the attention norm, the q and k norms, the MLP norm and the
layer index, five a layer; RESULTS.md "Session 29"). The decode kernels that take these vectors (the decode GEMV's
RMSNorm prologue, pallas_kernels/decode_gemv; the decode prologue's q / k norms, pallas_kernels/decode_prologue)
read the layer's row of the stack in place; everything else reads `vector[...]`, the row sliced out as before.

    data    [L, D]   the whole stack
    layer   None, or an int32 scalar: the row this layer reads (`at_layer`, called by the layer scan:
            surojax.models.layer_runner.split_in_place)

`surojax.quant.laid_out.norms_in_place` converts a served model's stacked norm scales once at load, where the decode
GEMV kernel is on. Serving only, like the kernels.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class StackedVector:
    data: jax.Array
    layer: jax.Array | None

    stacked_in_place = True  # the decoder's layer scan hands over the whole stack and the index (at_layer)

    def at_layer(self, index) -> "StackedVector":
        if self.data.ndim != 2 or self.layer is not None:
            raise ValueError(f"StackedVector: at_layer needs a [L, D] stack not yet at a layer, data "
                             f"{self.data.shape}, layer {self.layer}")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def row(self) -> jax.Array:
        """This layer's [D] (the whole [L, D] before `at_layer`), sliced out of the stack."""
        if self.layer is None:
            return self.data
        return jax.lax.dynamic_index_in_dim(self.data, self.layer, 0, keepdims=False)

    def __getitem__(self, key) -> jax.Array:
        return self.row()[key]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[1:] if self.layer is not None else self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self) -> str:
        return f"StackedVector({jnp.dtype(self.data.dtype).name}, data={list(self.data.shape)})"


jax.tree_util.register_dataclass(StackedVector, data_fields=["data", "layer"], meta_fields=[])


def in_place(value) -> tuple[jax.Array, jax.Array | None]:
    """A norm weight as a kernel takes it: (the stack [L, D] and its layer) for a StackedVector at a layer, else
    (the vector, None)."""
    if isinstance(value, StackedVector) and value.layer is not None:
        return value.data, value.layer
    return (value.row() if isinstance(value, StackedVector) else value), None


__all__ = ["StackedVector", "in_place"]
