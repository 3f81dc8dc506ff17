"""The two faces of a KV cache.

`LayerKV` is what one layer's attention sees: `update_and_attend` writes the new tokens' k/v and attends the
queries over the row's context, new tokens included. Attention calls it once and knows nothing else about the
cache (plain, stacked in the layer loop's carry, or a paged pool read by a kernel).

`Cache` is what the decoder sees: `step` makes one call's metadata and advances the cache's bookkeeping;
the layer loop runs over `per_layer()` (scanned as the loop's input, one slice per layer) or carries
`carried()` (every layer's k/v, written in place, with a layer index); `with_kv` takes the loop's result back.
"""
from __future__ import annotations

from typing import ClassVar, Protocol

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


class Cache(Protocol):
    """A whole model's cache, as `Decoder.hidden_states` drives it."""

    carry_only: ClassVar[bool]  # True: `per_layer` is not offered; the layer loop must carry the cache

    def step(self, segment_ids: jax.Array, positions: jax.Array) -> tuple[KVMeta, "Cache"]:
        """New tokens' segment ids / positions [B, T] -> (their metadata, this cache with its bookkeeping (slot
        ids, lengths) advanced past them; k/v not written yet)."""
        ...

    def carried(self) -> CarriedLayerKV:
        """Every layer's k/v for the loop's carry, at layer 0."""
        ...

    def per_layer(self) -> LayerKV:
        """Every layer's k/v stacked on a leading axis, for the loop to scan one slice per layer."""
        ...

    def with_kv(self, k: jax.Array, v: jax.Array) -> "Cache":
        """This cache holding the k/v the layer loop returned."""
        ...


__all__ = ["Cache", "CarriedLayerKV", "LayerKV"]
