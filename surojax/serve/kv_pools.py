"""The paged server's KV pools: one per KV shape, all addressed by the same slots.

A model's attention layers read cache parts (`LayerPattern.caches`, less a hybrid's state stacks): every model has
`layers`; Gemma 4 with full layers of their own shape (`global_head_dim`, their own kv heads) also
`global_layers`. The runner allocates one pool per part (`KVPool`), k and v each [pool layers, slots, kv heads,
head_dim] in that part's shape. Every pool has the same slots: a sequence's block table addresses all of them
(one `kv_cache.KVCacheManager`, one block table per sequence), and each call hands the decoder one
`PagedKVCache` per pool (`paged_cache`: a `StacksKVCache` of them when there are several).

Gemma 4's KV-shared layers (`num_kv_shared_layers`) read the cache part of their kind but hold no pool rows: their
cache rows name the pool row of the layer they share (`ModelConfig.kv_source`), which they read and never write
(`PagedKVCache.rows`), as transformers' cache hands a shared layer its source layer's keys / values. So a pool's
layers are the part's layers that compute keys / values, and the bytes per token the capacity sizing counts
(`capacity.kv_bytes_per_token`) are those of the pools actually allocated: KV-shared layers give more blocks.

`attention_k_eq_v` (Gemma 4's full layers) keeps a V pool: the values are the key projection's output before the
k norm and rope, v-normed, not the keys the cache holds (transformers caches both).

An FP8 pool (`kv_fp8`) has scales per pool row, bounded from the projections of the stack that owns the rows
(`kv_fp8.pool_bounds`); a KV-shared layer reads its source's rows and so their scales.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from surojax.models.config import ModelConfig
from surojax.models.decoder import layer_pattern
from surojax.models.kv import STATE_STACKS, PagedKVCache, StacksKVCache
from surojax.models.registry import GLOBAL_STACK

if TYPE_CHECKING:
    from surojax.serve.input_batch import StepSettings


@dataclasses.dataclass(frozen=True)
class KVPool:
    """One pool: the layers of cache part `part` ([num_kv_heads, head_dim] per token and layer). rows: per cache
    row of the part (its layers, in layer order), the pool row it reads; a KV-shared layer's names its source's."""

    part: str
    num_kv_heads: int
    head_dim: int
    rows: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        """The pool's layers: the part's layers that compute their own keys / values."""
        return len(set(self.rows))

    @property
    def row_map(self) -> tuple[int, ...] | None:
        """`PagedKVCache.rows`: the cache row -> pool row map, None where it is the identity (no KV-shared rows)."""
        return None if self.rows == tuple(range(len(self.rows))) else self.rows

    def shape(self, num_slots: int) -> tuple[int, int, int, int]:
        """k's (and v's) shape: [pool layers, slots, kv heads, head_dim]."""
        return self.num_layers, num_slots, self.num_kv_heads, self.head_dim

    def bytes_per_token(self, kv_dtype) -> int:
        """k and v of every pool layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(kv_dtype).itemsize


def kv_pools(cfg: ModelConfig) -> tuple[KVPool, ...]:
    """The pools a model of `cfg` is served with, in the order of its layer pattern's cache parts (`layers` first)."""
    pattern = layer_pattern(cfg)
    pools = []
    for part in pattern.caches:
        if part in STATE_STACKS:
            continue
        pool_row: dict[int, int] = {}  # layer computing its keys / values -> its pool row
        rows = []
        for i in range(cfg.num_layers):
            if pattern.layer(i)[0].cache_part != part:
                continue
            source = cfg.kv_source(i) if cfg.layer_is_kv_shared(i) else i
            if source not in pool_row:
                if source != i:
                    raise ValueError(f"{cfg.model_type}: KV-shared layer {i} reads layer {source}, which is not an "
                                     f"earlier layer of its cache part {part!r}")
                pool_row[i] = len(pool_row)
            rows.append(pool_row[source])
        shaped = cfg.global_config() if part == GLOBAL_STACK else cfg
        pools.append(KVPool(part, shaped.num_kv_heads, shaped.head_dim, tuple(rows)))
    return tuple(pools)


def paged_cache(k_pool, v_pool, block_table, lengths, settings: StepSettings):
    """The decoder's cache over the runner's pools: one `PagedKVCache` (k_pool / v_pool arrays) or, with several
    pools (``settings.pools``), a `StacksKVCache` of one per pool (k_pool / v_pool tuples in that order). An FP8
    pool's ``settings.scales`` come in the same form: one `KVScales`, or a tuple of one per pool (rows as the
    pool's rows: `kv_fp8.kv_scales`). Its ``k`` / ``v`` after the call are the new pools, in the same form."""
    pools = settings.pools

    def one(k, v, pool: KVPool | None, scales):
        return PagedKVCache(k, v, block_table, lengths, settings.block_size, settings.kernel, scales,
                            settings.fresh, None if pool is None else pool.row_map)

    if len(pools) <= 1:
        return one(k_pool, v_pool, pools[0] if pools else None, settings.scales)
    scales = (None,) * len(pools) if settings.scales is None else settings.scales
    if len(scales) != len(pools):
        raise ValueError(f"paged_cache: {len(pools)} KV pools need one FP8 scale set each, got {len(scales)}")
    return StacksKVCache(tuple(one(k, v, p, s) for k, v, p, s in zip(k_pool, v_pool, pools, scales, strict=True)),
                         tuple(p.part for p in pools))


__all__ = ["KVPool", "kv_pools", "paged_cache"]
