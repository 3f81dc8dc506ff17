"""The faces of a model cache.

`LayerKV` is what one attention layer sees: `update_and_attend` writes the new tokens' k/v and attends the
queries over the row's context, new tokens included. Attention calls it once and knows nothing else about the
cache (plain, stacked in the layer loop's carry, or a paged pool read by a kernel). A linear-attention layer sees
a `LayerState` instead (kv/recurrent.py: its conv and recurrent state, read and written whole).

`StackCache` is the cache of one layer stack (leaves [rows, ...], row r = the stack's r-th layer, exactly as the
stack's parameters): the layer loop runs over `per_layer()` (scanned as the loop's input, one slice per layer,
sliced as the stack's parameters are) or carries `carried()` (every row, written in place, with a `layer` row
index the loop advances after each of that stack's layers); `with_layers(view)` takes the loop's result back
(the per-layer views stacked [rows, ...], or the carried view after the stack's last layer).

`Cache` is what the decoder sees: `step` makes one call's metadata (shared by every layer: the sequence's
positions / segment ids) and advances the cache's bookkeeping; `parts(stacks)` gives the layer loop one
`StackCache` per stack of the layer pattern and `with_parts` takes them back. A cache over one stack is its own
part (`OneStack`: `KVCache`, `PagedKVCache`, every model of one layer stack); a hybrid model's cache has one part
per stack (`HybridCache`: the attention layers' `KVCache`, the linear-attention layers' `StateCache`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import jax

from surojax.models.kv.meta import AttendSpec, KVMeta


class LayerKV(Protocol):
    """One layer's view of a cache (a pytree)."""

    def update_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, meta: KVMeta,
                          spec: AttendSpec) -> tuple[jax.Array, "LayerKV"]:
        """q [B, T, N, H], the new tokens' k/v [B, T, K, H] -> (out [B, T, N, H], this view with k/v written)."""
        ...


class CarriedLayerKV(LayerKV, Protocol):
    """A `LayerKV` over every layer's k/v [L, ...] that rides in the layer loop's carry; `layer` [] int32 is the
    layer it serves (the loop advances it)."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array


class StackCache(Protocol):
    """The cache of one layer stack, as the layer loop drives it (a pytree)."""

    carry_only: ClassVar[bool]  # True: `per_layer` is not offered; the layer loop must carry this part

    def carried(self) -> Any:
        """Every row for the loop's carry, a view with a `layer` [] int32 row index, at row 0."""
        ...

    def per_layer(self) -> Any:
        """Every row's view stacked on a leading axis [rows, ...], for the loop to scan one slice per layer."""
        ...

    def with_layers(self, view) -> "StackCache":
        """This part holding what the layer loop returned: the per-layer views stacked [rows, ...] or the
        carried view (same fields, every row)."""
        ...


class Cache(Protocol):
    """A whole model's cache, as `Decoder.hidden_states` drives it."""

    def step(self, segment_ids: jax.Array, positions: jax.Array) -> tuple[KVMeta, "Cache"]:
        """New tokens' segment ids / positions [B, T] -> (their metadata, this cache with its bookkeeping (slot
        ids, lengths) advanced past them; k/v and states not written yet)."""
        ...

    def parts(self, stacks: tuple[str, ...]) -> Mapping[str, StackCache]:
        """The cache of each stack the layer pattern reads (`LayerPattern.stacks`), by stack name."""
        ...

    def with_parts(self, parts: Mapping[str, StackCache]) -> "Cache":
        """This cache holding the parts the layer loop returned."""
        ...


class OneStack:
    """`Cache.parts` / `with_parts` of a cache over the layers of a one-stack pattern (any number of layer types
    over that stack, e.g. gpt_oss's windows): the cache is that stack's part."""

    def parts(self, stacks: tuple[str, ...]) -> dict[str, StackCache]:
        if len(stacks) != 1:
            raise ValueError(f"{type(self).__name__} is the cache of one layer stack; this layer pattern reads the "
                             f"stacks {list(stacks)}: give it a cache with one part per stack (kv.HybridCache)")
        return {stacks[0]: self}

    def with_parts(self, parts: Mapping[str, StackCache]):
        (part,) = parts.values()
        return part


__all__ = ["Cache", "CarriedLayerKV", "LayerKV", "OneStack", "StackCache"]
