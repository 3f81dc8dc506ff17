"""The serving runner's paged KV pool as a cache the decoder reads and writes in place (no per-row dense view).

    k, v [L, N, K, H]: every layer's pool, N = blocks * block_size slots shared by every row. Row b's token p
    lives in slot ``block_table[b, p // bs] * bs + p % bs``.

Each layer writes its new tokens' k/v into its slice of the pool (the pool rides in the layer loop's carry) and
reads its rows' context through the block table; how it reads is the `PagedKernel`, decided once by whoever
builds the cache (the serving engine):

    GATHER  gather the layer's [B, NB * bs, K, H] context, then the attention backend (exact)
    REDUCE  one-token rows: that gather feeds `reduce_decode_attention`, multiply + reduce that XLA may fuse
            the gather into (equal up to float rounding); other rows gather
    PALLAS  one-token rows: the Pallas paged decode-attention kernel (`pallas_kernels.paged_decode`) reads
            each row's real blocks inside the kernel, online softmax (equal up to float rounding); other rows,
            sliding windows (static or per layer), attention sinks (the kernel has none), a softmax scale other
            than H ** -0.5 (Gemma's query_pre_attn_scalar; the kernel's is fixed) and pools past int32 offsets
            gather

Fresh calls (``fresh``, set by the caller when no row has a token in the pool before the call: a prefill of new
prompts, the serving runner's usual prefill): the new k/v are written as always, but nothing is read back: the
rows' context IS the call's tokens, so attention is self-attention over the call's k/v as the pool stores them
(`PagedLayerKV.stored`: cast to the pool's dtype, an FP8 pool's codes x scale) with the layer's packed kernel
where it has one (cuDNN) or its dense backend with a [B, T, T] mask (`AttendSpec.attend_self`): no per-layer
gather, S = T instead of the context bucket. Same values as the gather path up to float rounding.

Pool rows (`rows`, static; None: cache row i is pool row i): the pool row each cache row of the stack reads.
Gemma 4's KV-shared layers hold no pool rows of their own: their cache rows name their source layer's pool row
(as transformers' cache hands a shared layer its source's keys / values); such a row writes nothing (its keys /
values are its source's, already written by the source earlier in the same call) and reads the source's row.

FP8 pool (`scales` set, a `KVScales`-like value with ``at(layer) -> (k scale, v scale)``): k/v are stored as
float8_e4m3fn codes x / scale, saturated (`quantize`, given with the scales); every read dequantises (codes x
scale, in fp32) before attention; the Pallas kernel loads the codes and casts them in-kernel, the k scale folded
into q and the v scale into its output (q . (s k) = (s q) . k; sum p (s v) = s sum p v).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels.paged_decode import kernel_applies, paged_decode_attention
from surojax.models.kv.meta import MASKED, AttendSpec, PagedKVMeta, softmax_with_sinks
from surojax.models.kv.protocol import OneStack


class PagedKernel(enum.Enum):
    """How decode attention reads the paged pool (see the module docstring)."""

    GATHER = "gather"
    REDUCE = "reduce"
    PALLAS = "pallas"


def reduce_decode_attention(q, k, v, mask, scale: float, sinks: jax.Array | None = None) -> jax.Array:
    """One query token per row as multiply + reduce instead of dots: q [B, 1, N, H], k/v [B, S, K, H] (fp32),
    mask [B, 1, S], sinks None or [N] -> [B, 1, N, H]. The math of a dot-product attention (probabilities kept in
    fp32; a sink logit joins each head's denominator), written so that XLA can fuse a gather producing k/v into
    the two reductions (dots take materialised operands)."""
    B, _, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, 1, K, N // K, H).astype(jnp.float32)  # [B, 1, K, G, H]
    scores = jnp.sum(qg * k[:, :, :, None, :], axis=-1) * scale  # [B, S, K, G]
    scores = jnp.where(mask[:, 0, :, None, None], scores, MASKED)
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.reshape(1, 1, K, N // K), axis=1)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1)  # [B, K, G, H]
    return out.reshape(B, 1, N, H).astype(q.dtype)


def owned_rows(rows: tuple[int, ...]) -> tuple[bool, ...]:
    """Per cache row: whether it writes its pool row (the first cache row naming it; a later one, a KV-shared
    layer's, reads it only)."""
    return tuple(r not in rows[:i] for i, r in enumerate(rows))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "layer"],
                   meta_fields=["block_size", "kernel", "scales", "fresh", "rows"])
@dataclasses.dataclass(frozen=True)
class PagedLayerKV:
    """The pool as one layer sees it: every layer's k, v [L, N, K, H] and this layer's cache row [] int32 (its
    pool row: ``rows[layer]`` with a row map, module docstring). Only this layer's [B, S, K, H] is ever gathered
    (S = NB * bs), never an [L, B, S, K, H] view."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array
    block_size: int
    kernel: PagedKernel = PagedKernel.GATHER
    scales: object | None = None  # FP8 pool: a `surojax.serve.kv_fp8.KVScales`; None: stored as is
    fresh: bool = False  # no row has context before the call: attend over the new tokens, read nothing
    rows: tuple[int, ...] | None = None  # cache row -> pool row (KV-shared layers); None: the identity

    @property
    def num_rows(self) -> int:
        """The cache rows (layers) this view serves: the row map's length, else the pool's layers."""
        return self.k.shape[0] if self.rows is None else len(self.rows)

    @property
    def pool_row(self) -> jax.Array:
        """The pool row this layer reads and writes [] int32."""
        return self.layer if self.rows is None else jnp.asarray(self.rows, jnp.int32)[self.layer]

    def write(self, k, v, slots) -> "PagedLayerKV":
        """k, v [B, T, K, H] into this layer's pool slots [B, T] (a slot >= N is dropped: padding; a KV-shared
        layer's row writes nothing: its source wrote the same keys / values)."""
        l = self.pool_row
        if self.rows is not None and not all(owned_rows(self.rows)):
            slots = jnp.where(jnp.asarray(owned_rows(self.rows))[self.layer], slots, self.k.shape[1])
        if self.scales is not None:
            ks, vs = self.scales.at(l)
            k, v = self.scales.quantize(k, ks), self.scales.quantize(v, vs)
        T, bs = k.shape[1], self.block_size
        if self.fresh and T % bs == 0:  # every row starts at position 0: its tokens fill its blocks from the first slot
            return dataclasses.replace(self, k=_write_blocks(self.k, l, k, slots, bs),
                                       v=_write_blocks(self.v, l, v, slots, bs))
        # unique_indices: a row's new tokens take distinct slots of its own blocks (padding: N, dropped); without
        # the promise XLA's GPU scatter writes every element by an atomic read-modify-write (bf16: a CAS loop)
        write = functools.partial(_set_slots, layer=l, slots=slots)
        return dataclasses.replace(self, k=write(self.k, k), v=write(self.v, v))

    def read(self, block_table, dtype) -> tuple[jax.Array, jax.Array]:
        """block_table [B, NB] -> this layer's k, v [B, NB * bs, K, H] (view slot j = token position j)."""
        L, N, K, H = self.k.shape
        B, NB = block_table.shape
        bs = self.block_size

        def gather(pool, scale):  # whole blocks: [B, NB, bs, K, H]
            blocks = pool.reshape(L, N // bs, bs, K, H)[self.pool_row, block_table].reshape(B, NB * bs, K, H)
            return blocks.astype(dtype) if scale is None else self.scales.dequantize(blocks, scale, dtype)

        ks, vs = (None, None) if self.scales is None else self.scales.at(self.pool_row)
        return gather(self.k, ks), gather(self.v, vs)

    def stored(self, k, v, dtype) -> tuple[jax.Array, jax.Array]:
        """New k, v [B, T, K, H] as `read` returns them once `write` stored them (the pool's dtype, an FP8
        pool's codes x scale), in `dtype`."""
        if self.scales is None:
            return k.astype(self.k.dtype).astype(dtype), v.astype(self.v.dtype).astype(dtype)
        ks, vs = self.scales.at(self.pool_row)
        return (self.scales.dequantize(self.scales.quantize(k, ks).astype(self.k.dtype), ks, dtype),
                self.scales.dequantize(self.scales.quantize(v, vs).astype(self.v.dtype), vs, dtype))

    def update_and_attend(self, q, k, v, meta: PagedKVMeta, spec: AttendSpec) -> tuple[jax.Array, "PagedLayerKV"]:
        """Write k/v [B, T, K, H] at meta.write_slots; attend q [B, T, N, H] over each row's blocks (a fresh call:
        over the new tokens themselves, module docstring)."""
        kv = self.write(k, v, meta.write_slots)
        if kv.fresh:
            ck, cv = kv.stored(k, v, q.dtype)
            return spec.attend_self(q, ck, cv, meta.q_segment_ids, meta.q_positions), kv
        return kv.attend_written(q, meta, spec)

    def attend_written(self, q, meta: PagedKVMeta, spec: AttendSpec) -> tuple[jax.Array, "PagedLayerKV"]:
        """Attend q [B, T, N, H] over each row's blocks, the call's new k/v already in the pool (written by
        `write`, or by the fused decode prologue, pallas_kernels.decode_prologue); not for a fresh call, whose
        attention reads the new tokens themselves."""
        if self.fresh:
            raise ValueError("PagedLayerKV.attend_written: a fresh call attends over its new k/v (update_and_attend)")
        kv = self
        T = q.shape[1]
        if kv.kernel is PagedKernel.PALLAS and spec.sinks is None and spec.scale == q.shape[-1] ** -0.5 \
                and kernel_applies(kv.k.shape, T, spec.sliding_window):
            q1 = q[:, 0]  # [B, N, H]
            if kv.scales is None:
                out = paged_decode_attention(q1, kv.k, kv.v, kv.pool_row, meta.block_table, meta.lengths,
                                             block_size=kv.block_size)  # [B, N, H]
            else:  # fp8 codes: the scales folded into q and the output
                ks, vs = kv.scales.at(kv.pool_row)
                out = paged_decode_attention((q1.astype(jnp.float32) * ks).astype(q.dtype), kv.k, kv.v, kv.pool_row,
                                             meta.block_table, meta.lengths, block_size=kv.block_size)
                out = (out.astype(jnp.float32) * vs).astype(q.dtype)
            return out[:, None], kv
        if kv.kernel is PagedKernel.REDUCE and T == 1:
            ck, cv = kv.read(meta.block_table, jnp.float32)
            return reduce_decode_attention(q, ck, cv, meta.mask(spec.sliding_window), spec.scale, spec.sinks), kv
        ck, cv = kv.read(meta.block_table, q.dtype)
        return spec.attend(q, ck, cv, meta), kv


def _set_slots(pool, x, *, layer, slots):
    """pool [L, N, K, H] with x [B, T, K, H] written at (layer, slots [B, T]); slots >= N dropped. The in-bound slots
    are distinct (the caller's promise: a token's slot belongs to its row alone), so XLA writes plain stores."""
    return pool.at[layer, slots].set(x.astype(pool.dtype), mode="drop", unique_indices=True)


def _write_blocks(pool, layer, x, slots, bs: int):
    """`PagedLayerKV.write` of a fresh call with T a multiple of bs: pool [L, N, K, H], x [B, T, K, H], slots
    [B, T] (N: not written) -> the same pool as the token-by-token scatter. A fresh row's real tokens are a prefix
    of the row starting at position 0, so its j-th block holds its tokens j bs .. j bs + bs - 1: the row's full
    blocks go in as one scatter row per block and the tokens of its last, partly filled block (at most bs - 1) by
    the token scatter, both with distinct in-bound indices (`_set_slots`). Nothing is read from the pool: reading
    the partial block back to merge it (session 26's first version) made XLA copy the whole pool once per layer on
    the GPU (a 73 ms memcpy in a 16 x 512 prefill, session 27). Either scatter without unique_indices ran at
    ~0.1-0.2 TB/s there (4.6 ms of a 26 ms 16 x 512 call): XLA's GPU scatter then writes by atomics."""
    L, N, K, H = pool.shape
    B, T = slots.shape
    nb = N // bs
    x = x.astype(pool.dtype)
    full = jnp.sum(slots < N, axis=1) // bs  # [B] blocks whose bs slots are all real
    first = slots[:, ::bs] // bs  # [B, T / bs]: the block of each block-start token
    blocks = jnp.where(jnp.arange(T // bs)[None, :] < full[:, None], first, nb)  # nb: dropped
    pool = pool.reshape(L, nb, bs, K, H).at[layer, blocks].set(x.reshape(B, T // bs, bs, K, H), mode="drop",
                                                           unique_indices=True)
    tail = full[:, None] * bs + jnp.arange(bs)[None, :]  # [B, bs] the partial block's token indices
    tail_slots = jnp.where(tail < T, jnp.take_along_axis(slots, jnp.minimum(tail, T - 1), axis=1), N)
    tail_x = jnp.take_along_axis(x, jnp.minimum(tail, T - 1)[:, :, None, None], axis=1)
    return _set_slots(pool.reshape(L, N, K, H), tail_x, layer=layer, slots=tail_slots)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "block_table", "lengths"],
                   meta_fields=["block_size", "kernel", "scales", "fresh", "rows"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache(OneStack):
    """The pool as the decoder drives it. k, v [L, N, K, H]; block_table [B, NB] (entries past a row's blocks
    are ignored); lengths [B] = tokens of each row already in the pool. One sequence per row, positions 0, 1,
    2 ... The new tokens (segment id > 0) are written at positions lengths .. lengths + T - 1, which must have
    blocks in the table (NB * bs >= lengths + T); padding tokens (segment id 0) are not written and do not
    count. Always carried by the layer loop (written in place). scales: None, or for an FP8 pool a static value
    with ``at(layer)``, ``quantize(x, scale)`` and ``dequantize(codes, scale, dtype)`` (`serve.kv_fp8.KVScales`).
    fresh: the caller's promise that every row's ``lengths`` is 0 (nothing cached before this call): attention
    reads nothing from the pool (module docstring); wrong values if a row has context. rows: the stack's cache row
    -> pool row map (Gemma 4's KV-shared layers read their source's row; module docstring), None: the identity."""

    k: jax.Array
    v: jax.Array
    block_table: jax.Array
    lengths: jax.Array
    block_size: int
    kernel: PagedKernel = PagedKernel.GATHER
    scales: object | None = None
    fresh: bool = False
    rows: tuple[int, ...] | None = None

    carry_only: ClassVar[bool] = True

    def step(self, segment_ids, positions) -> tuple[PagedKVMeta, "PagedKVCache"]:
        """segment_ids / positions [B, T] -> (their `PagedKVMeta`, this cache with lengths advanced past them).
        The meta's context view has S = NB * bs slots, view slot j = token position j."""
        B, T = segment_ids.shape
        NB = self.block_table.shape[1]
        bs, S, N = self.block_size, self.block_table.shape[1] * self.block_size, self.k.shape[1]
        rows = jnp.arange(B)[:, None]
        p = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T] positions = view slots
        block = jnp.take_along_axis(self.block_table, jnp.minimum(p // bs, NB - 1), axis=1)
        write = jnp.where((segment_ids > 0) & (p < S), block * bs + p % bs, N).astype(jnp.int32)
        j = jnp.arange(S, dtype=jnp.int32)[None, :]
        ctx = j < self.lengths[:, None]
        kv_seg = ctx.astype(jnp.int32).at[rows, p].set(segment_ids, mode="drop", unique_indices=True)
        kv_pos = jnp.where(ctx, j, 0).astype(jnp.int32).at[rows, p].set(positions, mode="drop", unique_indices=True)
        lengths = self.lengths + jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32)
        meta = PagedKVMeta(segment_ids, positions, write, kv_seg, kv_pos, self.block_table, lengths)
        return meta, dataclasses.replace(self, lengths=lengths)

    def carried(self) -> PagedLayerKV:
        return PagedLayerKV(self.k, self.v, jnp.int32(0), self.block_size, self.kernel, self.scales, self.fresh,
                            self.rows)

    def per_layer(self):
        raise TypeError("PagedKVCache is carried by the layer loop (carry_only), never scanned per layer")

    def with_layers(self, view: PagedLayerKV) -> "PagedKVCache":
        return dataclasses.replace(self, k=view.k, v=view.v)


__all__ = ["PagedKVCache", "PagedKernel", "PagedLayerKV", "owned_rows", "reduce_decode_attention"]
