"""What a KV cache and attention hand each other: the per-call metadata (`KVMeta`, `PagedKVMeta`), the mask
they imply, and how the attention computes over a dense context (`AttendSpec`).

A cache turns one call's new tokens (segment ids / positions [B, T]) into a metadata value once per call
(`KVCache.step`, `PagedKVCache.step`); every layer's attention passes that value, unchanged, to its layer's
cache (`LayerKV.update_and_attend`). Both metadata classes are frozen pytrees of arrays (they cross `jit` and
`lax.scan` as constants).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: softmax sends it to 0, no inf - inf = NaN


def attention_mask(q_seg, kv_seg, q_pos, kv_pos, sliding_window: int | None = None) -> jax.Array:
    """[B, T] x [B, S] segment ids and positions -> boolean mask [B, T, S] (True = may attend).

    Query t sees key s when both are in the same segment and pos[s] <= pos[t] (and, with a sliding window W,
    pos[t] - pos[s] < W). Segment id 0 is padding / an empty slot."""
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    causal = kv_pos[:, None, :] <= q_pos[:, :, None]
    mask = same & causal
    if sliding_window is not None:
        mask &= (q_pos[:, :, None] - kv_pos[:, None, :]) < sliding_window
    return mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVMeta:
    """One call's new tokens against a dense per-row context of S slots (view slot j = the row's slot j).

    q_segment_ids, q_positions [B, T]: the new tokens; write_slots [B, T]: where each new token's k/v goes
    (the cache's slot index, per row); kv_segment_ids, kv_positions [B, S]: every slot after the write
    (0 = empty)."""

    q_segment_ids: jax.Array
    q_positions: jax.Array
    write_slots: jax.Array
    kv_segment_ids: jax.Array
    kv_positions: jax.Array

    def mask(self, sliding_window: int | None) -> jax.Array:
        """[B, T, S]: which context slots each new token attends to."""
        return attention_mask(self.q_segment_ids, self.kv_segment_ids, self.q_positions, self.kv_positions,
                              sliding_window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVMeta(KVMeta):
    """`KVMeta` for a paged pool: write_slots [B, T] are POOL slots (N, out of range, where a token is not
    written: padding); the context view is the row's blocks in table order, S = NB * block_size (view slot j =
    token position j). block_table [B, NB]; lengths [B] = each row's tokens after this call's."""

    block_table: jax.Array
    lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class AttendSpec:
    """How attention computes over a dense context, fixed per layer (static, not a pytree).

    dense(q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S], scale) -> [B, T, N, H]: the attention backend.
    scale: the softmax scale (H ** -0.5); sliding_window: None or W (see `attention_mask`)."""

    dense: Callable[..., jax.Array]
    scale: float
    sliding_window: int | None = None


__all__ = ["MASKED", "AttendSpec", "KVMeta", "PagedKVMeta", "attention_mask"]
