"""The paged decode-attention Pallas (Triton) kernel: one query token per row reads its k/v blocks straight
from the paged pool through the block table (flash-decoding: online softmax over blocks, each row's context
split into P partitions per (row, kv head), merged afterwards). No [B, S, K, H] gather is materialised, and only
each row's real blocks are read (a partition's loop stops at the row's length), not the table's padding.

    q [B, N, H] (N = K * G), pools k/v [L, NBLK * bs, K, H], layer [] int32, block_table [B, NB],
    lengths [B] -> out [B, N, H]

The pools are read as one [L * NBLK] view; the kernel adds layer * NBLK to the table's block ids itself (layer is
a [1] operand, like a row's length), so the table and its padding are the same in every layer (XLA can hoist
them out of a loop over layers).

`paged_decode_pallas` takes every knob explicitly (no defaults, no validation: `api.paged_decode_attention` is
the public entry). The knobs:

    blocks_per_iter  pool blocks read per loop iteration (bs * blocks_per_iter keys; a power of two on a GPU)
    partitions       P, partitions per (row, kv head)
    num_warps, num_stages   Triton's launch / software-pipelining parameters
    qk               "dot": the kv head's G query heads padded to MIN_QUERY_ROWS rows, scores and output by
                     tensor-core dots; "fma": the G rows alone, scores and output as elementwise products summed
                     over H and over the keys, one query head at a time (no MMA; k/v loaded an iteration ahead)
    split            "table": partition p covers the block table's p-th slice, whatever the row's length (with
                     the table's padding, the last partitions of a short row have nothing to do); "length":
                     p covers the p-th of P equal shares of the row's real blocks
    merge            how the P partitions' (o, m, l) become the output: "xla" (jnp ops after the call: XLA makes
                     a handful of small kernels of them), "pallas" (`_merge_kernel`, a second pallas_call over
                     (B, K); the partition outputs are allocated with P rounded up to a power of two)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_decode.reference import MASKED as _MASKED

MIN_QUERY_ROWS = 16  # Triton's dot wants >= 16 rows: a kv head's G query heads are padded to this
MERGE_NUM_WARPS = 4  # the Pallas merge's warps: a program holds [Pp, H] fp32 (Pp = 64 is 64 registers a thread)


def _kernel(q_ref, k_ref, v_ref, table_ref, len_ref, layer_ref, o_ref, m_ref, l_ref, *, block_size: int,
            blocks_per_iter: int, layer_blocks: int, scale: float, qk: str, split: str):
    """One program: (row b, kv head, partition p). q_ref [Gp, H]; k_ref/v_ref this kv head's column of the
    whole pool ([L * NBLK, bs, H] for qk="dot", [L * NBLK * bs, H] for "fma"); table_ref the partition's block
    ids [NBp] (split="table") or the row's [NB + blocks_per_iter - 1] (split="length"), ids within one layer;
    len_ref [1]; layer_ref [1]: block id + layer * layer_blocks (NBLK) is the block in the [L * NBLK] view.
    Writes the partition's unnormalised output [Gp, H], running max and sum [Gp]."""
    p, num_p = pl.program_id(2), pl.num_programs(2)
    it, bs = blocks_per_iter, block_size
    length = len_ref[0]
    base = layer_ref[0] * layer_blocks  # the layer's first block in the [L * NBLK] view
    if split == "table":  # partition p: table blocks [p * NBp, (p + 1) * NBp), whatever the row's length
        nbp = table_ref.shape[0]
        first, offset = p * nbp, 0  # the partition's first block of the row, its index in table_ref
        row_blocks = pl.cdiv(length, bs)
    else:  # P equal shares of the row's real blocks (rounded up to whole iterations)
        row_blocks = jnp.minimum(pl.cdiv(length, bs), table_ref.shape[0] - (it - 1))
        nbp = pl.cdiv(pl.cdiv(row_blocks, num_p), it) * it
        first = offset = p * nbp
    n_iter = pl.cdiv(jnp.clip(row_blocks - first, 0, nbp), it)  # iterations over this partition's real blocks
    chunk = it * bs

    def valid(i):  # [chunk] which of iteration i's keys the row attends to
        return (first + i * it) * bs + jnp.arange(chunk) < length

    if qk == "dot":
        o, m, l = _attend_dot(q_ref[...], k_ref, v_ref, table_ref, base, offset, n_iter, valid, it, scale)
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l
    else:
        heads = _attend_fma(q_ref, k_ref, v_ref, table_ref, base, offset, n_iter, valid, it, bs, scale)
        for g, (o, m, l) in enumerate(heads):
            o_ref[g] = o
            m_ref[g] = m
            l_ref[g] = l


def _attend_dot(q, k_ref, v_ref, table_ref, base, offset, n_iter, valid, it: int, scale: float):
    """Online softmax over n_iter iterations of `it` whole blocks, scores and output by tensor-core dots:
    q [Gp, H] (Gp >= 16 rows, mostly padding when G is small) -> o [Gp, H], m [Gp], l [Gp]."""
    gp, h = q.shape

    def body(i, carry):
        o, m, l = carry
        blocks = table_ref[pl.ds(offset + i * it, it)] + base
        k = k_ref[blocks].reshape(-1, h).astype(q.dtype)  # [chunk, H]
        v = v_ref[blocks].reshape(-1, h).astype(q.dtype)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # [Gp, chunk]
        s = jnp.where(valid(i)[None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new[:, None])
        l = corr * l + e.sum(axis=1)
        o = corr[:, None] * o + jnp.dot(e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o, m_new, l

    init = (jnp.zeros((gp, h), jnp.float32), jnp.full((gp,), _MASKED, jnp.float32), jnp.zeros((gp,), jnp.float32))
    return jax.lax.fori_loop(0, n_iter, body, init)


def _attend_fma(q_ref, k_ref, v_ref, table_ref, base, offset, n_iter, valid, it: int, bs: int, scale: float):
    """The same online softmax for each of the G query heads on its own, as multiplies summed over H (scores)
    and over the keys (output), in fp32: no padded rows, no MMA. Keys are gathered slot by slot ([chunk, H]
    straight from the [slots, H] pool view, no reshape), one iteration ahead: Triton pipelines only loads that
    feed a dot, so the next iteration's k/v are loaded (into registers) before this one's math. Returns G
    tuples (o [H], m [], l [])."""
    h = q_ref.shape[1]
    chunk = it * bs
    tok = jnp.arange(chunk)
    last = table_ref.shape[0] - 1
    qs = [q_ref[g].astype(jnp.float32) for g in range(q_ref.shape[0])]  # G x [H]

    def load(i):  # iteration i's k, v [chunk, H]; past the partition's end (the prefetch after the last
        # iteration) the table index is clamped: a real block, read and never used
        slots = (table_ref[jnp.minimum(offset + i * it + tok // bs, last)] + base) * bs + tok % bs  # [chunk]
        return k_ref[slots], v_ref[slots]

    def body(i, carry):
        (k, v), heads = carry
        ahead = load(i + 1)
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        mask = valid(i)
        out = []
        for q, (o, m, l) in zip(qs, heads):
            s = jnp.where(mask, jnp.sum(k * q[None, :], axis=1) * scale, _MASKED)  # [chunk]
            m_new = jnp.maximum(m, s.max())
            corr = jnp.exp(m - m_new)
            e = jnp.exp(s - m_new)
            out.append((corr * o + jnp.sum(e[:, None] * v, axis=0), m_new, corr * l + e.sum()))
        return ahead, tuple(out)

    init = tuple((jnp.zeros((h,), jnp.float32), jnp.float32(_MASKED), jnp.float32(0.0)) for _ in qs)
    return jax.lax.fori_loop(0, n_iter, body, (load(0), init))[1]


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, partitions: int):
    """One program: (row b, kv head). o_ref [Pp, Gp, H], m_ref / l_ref [Pp, Gp] fp32, the partitions' outputs
    (Pp: P rounded up to a power of two for Triton; partitions P.. were never written, their memory is
    uninitialised: masked off by index in the loads, never read); out_ref [G, H] (the real query rows) in q's
    dtype. The same math as `_merge_xla`, one query row at a time."""
    pp = m_ref.shape[0]
    h = o_ref.shape[2]
    written = jnp.arange(pp) < partitions  # [Pp]
    written_o = jnp.broadcast_to(written[:, None], (pp, h))
    for g in range(out_ref.shape[0]):
        g = jnp.int32(g)  # an array index: interpret mode's masked load takes no Python int
        m = plgpu.load(m_ref.at[:, g], mask=written, other=_MASKED)  # [Pp]
        l = plgpu.load(l_ref.at[:, g], mask=written, other=0.0)
        o = plgpu.load(o_ref.at[:, g, :], mask=written_o, other=0.0)  # [Pp, H]
        w = jnp.exp(m - m.max())
        total = jnp.sum(l * w)
        out = jnp.sum(o * w[:, None], axis=0) / jnp.where(total > 0, total, 1.0)
        out_ref[g] = out.astype(out_ref.dtype)


def _merge_pallas(o, m, l, *, partitions: int, rows: int, dtype, interpret: bool):
    """o [B, K, Pp, Gp, H], m / l [B, K, Pp, Gp] (partitions < P written) -> [B, K, G, H] in `dtype`: one
    pallas_call over a grid (B, K), in place of `_merge_xla`'s handful of small XLA kernels."""
    B, K, pp, gp, H = o.shape
    compiler_params = None if interpret else plgpu.CompilerParams(num_warps=MERGE_NUM_WARPS, num_stages=1)
    kernel = functools.partial(_merge_kernel, partitions=partitions)
    return pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=[pl.BlockSpec((None, None, pp, gp, H), lambda b, k: (b, k, 0, 0, 0)),
                  pl.BlockSpec((None, None, pp, gp), lambda b, k: (b, k, 0, 0)),
                  pl.BlockSpec((None, None, pp, gp), lambda b, k: (b, k, 0, 0))],
        out_specs=pl.BlockSpec((None, None, rows, H), lambda b, k: (b, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, rows, H), dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name="paged_decode_merge",
    )(o, m, l)


def _merge_xla(o, m, l, *, rows: int, dtype):
    """The partitions merged by XLA ops: o [B, K, P, Gp, H], m / l [B, K, P, Gp] -> [B, K, G, H] in `dtype`
    (an empty partition has m = _MASKED, l = 0, o = 0; a row with total weight 0 gets zeros)."""
    m_all = m.max(axis=2, keepdims=True)  # [B, K, 1, Gp]
    w = jnp.exp(m - m_all)  # [B, K, P, Gp]
    total = (l * w).sum(axis=2)  # [B, K, Gp]
    out = (o * w[..., None]).sum(axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :, :rows].astype(dtype)


def paged_decode_pallas(q, k_pool, v_pool, layer, block_table, lengths, *, block_size: int, partitions: int,
                        interpret: bool, blocks_per_iter: int, num_warps: int, num_stages: int, qk: str,
                        split: str, merge: str):
    """The kernel over a grid (B, K, P), then the merge of the P partitions (merge: "xla" or "pallas"). Shapes:
    the module docstring."""
    B, N, H = q.shape
    L, NS, K, _ = k_pool.shape
    G = N // K
    bs = block_size
    nblk = NS // bs
    NB = block_table.shape[1]
    it = blocks_per_iter
    P = partitions
    table = block_table.astype(jnp.int32)  # one layer's block ids: the same in every layer (the kernel adds
    # layer * nblk), so XLA may hoist this and the pad below out of a loop over layers
    if split == "table":  # [B, P, NBp]: each partition's slice, NBp blocks, a multiple of the blocks per iteration
        nbp = -(-NB // (P * it)) * it
        table = jnp.pad(table, ((0, 0), (0, P * nbp - NB))).reshape(B, P, nbp)
        table_spec = pl.BlockSpec((None, None, nbp), lambda b, k, p: (b, p, 0))
    else:  # [B, NB + it - 1]: the whole row (an iteration may read up to it - 1 blocks past the row's last); no
        # pad at one block an iteration (the default), which XLA would run as a kernel in every layer of the loop
        table = jnp.pad(table, ((0, 0), (0, it - 1))) if it > 1 else table
        table_spec = pl.BlockSpec((None, NB + it - 1), lambda b, k, p: (b, 0))
    if qk == "dot":  # query rows per program: G rounded up to a power of two, at least Triton's smallest dot
        gp = max(MIN_QUERY_ROWS, 1 << (G - 1).bit_length())
        pool_view = (L * nblk, bs, K, H)  # whole blocks
        pool_spec = pl.BlockSpec((L * nblk, bs, None, H), lambda b, k, p: (0, 0, k, 0))
    else:  # the G rows themselves
        gp = G
        pool_view = (L * NS, K, H)  # slot by slot
        pool_spec = pl.BlockSpec((L * NS, None, H), lambda b, k, p: (0, k, 0))
    # the partitions' outputs: P of them, or (merge="pallas") P rounded up to a power of two, the rest unwritten
    pp = P if merge == "xla" else 1 << (P - 1).bit_length()
    qg = jnp.pad(q.reshape(B, K, G, H), ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    kp, vp = k_pool.reshape(pool_view), v_pool.reshape(pool_view)
    kernel = functools.partial(_kernel, block_size=bs, blocks_per_iter=it, layer_blocks=nblk, scale=H ** -0.5, qk=qk,
                               split=split)
    compiler_params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, P),
        in_specs=[pl.BlockSpec((None, None, gp, H), lambda b, k, p: (b, k, 0, 0)), pool_spec, pool_spec,
                  table_spec, pl.BlockSpec((1,), lambda b, k, p: (b,)), pl.BlockSpec((1,), lambda b, k, p: (0,))],
        out_specs=[pl.BlockSpec((None, None, None, gp, H), lambda b, k, p: (b, k, p, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, k, p: (b, k, p, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, k, p: (b, k, p, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, pp, gp, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, pp, gp), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, pp, gp), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params,
        name="paged_decode_attention",
    )(qg, kp, vp, table, lengths.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32))
    if merge == "xla":
        out = _merge_xla(o, m, l, rows=G, dtype=q.dtype)
    else:
        out = _merge_pallas(o, m, l, partitions=P, rows=G, dtype=q.dtype, interpret=interpret)
    return out.reshape(B, N, H)


__all__ = ["MERGE_NUM_WARPS", "MIN_QUERY_ROWS", "paged_decode_pallas"]
