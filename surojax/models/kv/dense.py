"""The plain (unpaged) KV cache of generation: k, v [L, B, S, K, H], slots filled left to right per row.

Two layer views of it, same values: `DenseLayerKV` (one layer's [B, S, K, H] slice, scanned as the layer loop's
input and returned as its output) and `StackedLayerKV` (every layer's k/v in the loop's carry, the new tokens
written in place into layer ``layer``: one pass over the cache per layer instead of a copy in and out).
`StacksKVCache`: one such cache per attention stack when the stacks' shapes differ (Gemma 4's `global_layers`;
the serving pool's `PagedKVCache`s alike).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from surojax.models.config import ModelConfig
from surojax.models.kv.meta import AttendSpec, KVMeta
from surojax.models.kv.protocol import OneStack


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseLayerKV:
    """One layer's cache slice: k, v [B, S, K, H]."""

    k: jax.Array
    v: jax.Array

    def update_and_attend(self, q, k, v, meta: KVMeta, spec: AttendSpec) -> tuple[jax.Array, "DenseLayerKV"]:
        """Write k/v [B, T, K, H] at meta.write_slots [B, T]; attend q [B, T, N, H] over the S slots."""
        rows = jnp.arange(q.shape[0])[:, None]
        kv = DenseLayerKV(self.k.at[rows, meta.write_slots].set(k.astype(self.k.dtype)),
                          self.v.at[rows, meta.write_slots].set(v.astype(self.v.dtype)))
        out = spec.attend(q, kv.k.astype(q.dtype), kv.v.astype(q.dtype), meta)
        return out, kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayerKV:
    """Every layer's cache k, v [L, B, S, K, H] and the index [] int32 of the layer this view serves."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array

    def update_and_attend(self, q, k, v, meta: KVMeta, spec: AttendSpec) -> tuple[jax.Array, "StackedLayerKV"]:
        """Write k/v [B, T, K, H] into layer ``layer`` at meta.write_slots [B, T]; attend over that layer."""
        rows, l = jnp.arange(q.shape[0])[:, None], self.layer
        kv = StackedLayerKV(self.k.at[l, rows, meta.write_slots].set(k.astype(self.k.dtype)),
                            self.v.at[l, rows, meta.write_slots].set(v.astype(self.v.dtype)), l)
        out = spec.attend(q, kv.k[l].astype(q.dtype), kv.v[l].astype(q.dtype), meta)
        return out, kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(OneStack):
    """A plain cache for generation. k, v [L, B, S, K, H]; segment_ids [B, S] (0 = empty slot); positions
    [B, S]; lengths [B] = filled slots. A call's new tokens (padding included) take slots lengths .. lengths +
    T - 1 of each row; only real tokens (segment id > 0) count in lengths."""

    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    lengths: jax.Array

    carry_only: ClassVar[bool] = False

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype, num_layers: int | None = None) -> "KVCache":
        """Zeros for `num_layers` layers (None: every layer of `cfg`; a hybrid model: its attention layers)."""
        shape = (cfg.num_layers if num_layers is None else num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros_bs = jnp.zeros((batch, max_len), jnp.int32)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), zeros_bs, zeros_bs, jnp.zeros((batch,), jnp.int32))

    def step(self, segment_ids, positions) -> tuple[KVMeta, "KVCache"]:
        """segment_ids / positions [B, T] -> (their `KVMeta`, this cache with slot ids and lengths advanced)."""
        B, T = segment_ids.shape
        rows = jnp.arange(B)[:, None]
        slots = self.lengths[:, None] + jnp.arange(T)[None, :]  # [B, T]
        cache = dataclasses.replace(
            self,
            segment_ids=self.segment_ids.at[rows, slots].set(segment_ids),
            positions=self.positions.at[rows, slots].set(positions),
            lengths=self.lengths + jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32),
        )
        return KVMeta(segment_ids, positions, slots, cache.segment_ids, cache.positions), cache

    def carried(self) -> StackedLayerKV:
        return StackedLayerKV(self.k, self.v, jnp.int32(0))

    def per_layer(self) -> DenseLayerKV:
        return DenseLayerKV(self.k, self.v)

    def with_layers(self, view: DenseLayerKV | StackedLayerKV) -> "KVCache":
        return dataclasses.replace(self, k=view.k, v=view.v)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kvs"], meta_fields=["stacks"])
@dataclasses.dataclass(frozen=True)
class StacksKVCache:
    """The cache of a model whose attention layers come in stacks of different shapes (Gemma 4's sliding
    `layers` and its wider full `global_layers`): one one-stack cache per stack (`kvs[i]` over stack `stacks[i]`'s
    rows, in its shape): `KVCache`s for generation, `PagedKVCache`s (one pool per shape, the same block tables)
    for serving. Every part sees the same tokens: `step` advances each alike and hands the layers the first's
    metadata (the same values)."""

    kvs: tuple  # of KVCache or PagedKVCache, one per stack
    stacks: tuple[str, ...]

    @classmethod
    def empty(cls, shapes: dict[str, tuple[ModelConfig, int]], batch: int, max_len: int, dtype) -> "StacksKVCache":
        """shapes: stack -> (the config of its layers' shape, its rows)."""
        return cls(tuple(KVCache.empty(c, batch, max_len, dtype, num_layers=rows) for c, rows in shapes.values()),
                   tuple(shapes))

    @property
    def lengths(self) -> jax.Array:
        return self.kvs[0].lengths

    @property
    def k(self) -> tuple[jax.Array, ...]:
        """Every part's keys, in `stacks` order (the serving runner's pools)."""
        return tuple(kv.k for kv in self.kvs)

    @property
    def v(self) -> tuple[jax.Array, ...]:
        return tuple(kv.v for kv in self.kvs)

    def step(self, segment_ids, positions) -> tuple[KVMeta, "StacksKVCache"]:
        stepped = [kv.step(segment_ids, positions) for kv in self.kvs]
        return stepped[0][0], dataclasses.replace(self, kvs=tuple(kv for _, kv in stepped))

    def parts(self, stacks: tuple[str, ...]) -> dict[str, KVCache]:
        if sorted(stacks) != sorted(self.stacks):
            raise ValueError(f"this cache holds the stacks {list(self.stacks)}; the layer pattern reads "
                             f"{list(stacks)}")
        return dict(zip(self.stacks, self.kvs))

    def with_parts(self, parts) -> "StacksKVCache":
        return dataclasses.replace(self, kvs=tuple(parts[name] for name in self.stacks))


__all__ = ["DenseLayerKV", "KVCache", "StackedLayerKV", "StacksKVCache"]
