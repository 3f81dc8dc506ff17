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


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None, axis: int) -> jax.Array:
    """Softmax of fp32 `scores` over `axis`, with one extra logit per head (the sink) in the denominator only.

    sinks: None (a plain softmax) or logits broadcastable against `scores` with size 1 on `axis`. As transformers'
    gpt_oss `eager_attention_forward`: softmax over [scores, sink], then the sink's column dropped, so each row's
    probabilities sum to 1 - p(sink). A row whose scores are all MASKED gives zeros (its mass goes to the sink)."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=axis)
    sinks = sinks.astype(jnp.float32)
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=axis, keepdims=True), sinks))  # exact either way
    e = jnp.exp(scores - top)
    return e / (jnp.sum(e, axis=axis, keepdims=True) + jnp.exp(sinks - top))


def attention_mask(q_seg, kv_seg, q_pos, kv_pos, sliding_window: int | jax.Array | None = None) -> jax.Array:
    """[B, T] x [B, S] segment ids and positions -> boolean mask [B, T, S] (True = may attend).

    Query t sees key s when both are in the same segment and pos[s] <= pos[t] (and, with a sliding window W,
    pos[t] - pos[s] < W). Segment id 0 is padding / an empty slot. `sliding_window` is None (full attention), a
    static W, or a traced [] int32 W where 0 means full attention (a per-layer window scanned with the layer)."""
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    causal = kv_pos[:, None, :] <= q_pos[:, :, None]
    mask = same & causal
    if isinstance(sliding_window, jax.Array):
        mask &= (sliding_window <= 0) | ((q_pos[:, :, None] - kv_pos[:, None, :]) < sliding_window)
    elif sliding_window is not None:
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

    def mask(self, sliding_window: int | jax.Array | None) -> jax.Array:
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
    """How one layer's attention computes over a dense context (made by the layer inside the traced layer
    body; not a pytree, never crosses a jit boundary).

    dense(q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S], scale, sinks) -> [B, T, N, H]: the attention backend.
    scale: the softmax scale (H ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5); sliding_window: None, a static
    W, or the layer's traced [] int32 W (0 = full; see `attention_mask`); sinks: None or the layer's sink logits
    [N] (they join every softmax denominator; a kernel without sinks must not serve this layer). packed: None, or
    the layer's self-attention over packed rows without a mask, (q, k, v [B, T, ...], segment_ids, positions
    [B, T]) -> [B, T, N, H] with this scale / window (cuDNN's packed causal kernel; `attend_self`)."""

    dense: Callable[..., jax.Array]
    scale: float
    sliding_window: int | jax.Array | None = None
    sinks: jax.Array | None = None
    packed: Callable[..., jax.Array] | None = None

    def attend(self, q, k, v, meta: KVMeta) -> jax.Array:
        """q [B, T, N, H] over the context k/v [B, S, K, H] that `meta` describes -> [B, T, N, H]."""
        return self.dense(q, k, v, meta.mask(self.sliding_window), self.scale, self.sinks)

    def attend_self(self, q, k, v, segment_ids, positions) -> jax.Array:
        """Self-attention of one call's tokens among themselves (no cached context): q [B, T, N, H], k/v
        [B, T, K, H], segment_ids / positions [B, T] -> [B, T, N, H]; `packed` where the layer has one, else the
        dense backend with the call's own [B, T, T] mask."""
        if self.packed is not None:
            return self.packed(q, k, v, segment_ids, positions)
        mask = attention_mask(segment_ids, segment_ids, positions, positions, self.sliding_window)
        return self.dense(q, k, v, mask, self.scale, self.sinks)


__all__ = ["MASKED", "AttendSpec", "KVMeta", "PagedKVMeta", "attention_mask", "softmax_with_sinks"]
