"""Paged decode attention as a Pallas (Triton) kernel: one query token per row reads its k/v blocks straight
from the paged pool through the block table (flash-decoding: online softmax over blocks, each row's context
split into P partitions per (row, kv head), merged afterwards). No [B, S, K, H] gather is materialised, and only
each row's real blocks are read (a partition's loop stops at the row's length), not the S bucket's padding.

    q [B, N, H] (N = K * G), pools k/v [L, NBLK * bs, K, H] (the serving pool, every layer), layer [] int32,
    block_table [B, NB], lengths [B] (positions to attend to, the new token's included) -> out [B, N, H]

On a non-GPU backend the same kernel runs in Pallas interpret mode (tests); `paged_decode_reference` is the
pure-jnp definition it is checked against. Softmax in fp32, scale H ** -0.5, no sliding window. A row with
length 0 (padding) gets zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_QUERY_ROWS = 16  # Triton's dot wants >= 16 rows: a kv head's G query heads are padded to this
BLOCKS_PER_ITER = 4  # pool blocks per loop iteration of a program (bs * 4 keys: 64 at block size 16)
MIN_PROGRAMS = 1024  # split each row's context until the grid has about this many programs (fills 132 SMs)


def kernel_applies(pool_shape, num_query_tokens: int, sliding_window) -> bool:
    """The kernel serves one query token per row without a sliding window, over a pool whose element offsets fit
    in int32 (Triton's pointer arithmetic here); anything else takes the gather path."""
    n = 1
    for d in pool_shape:
        n *= d
    return num_query_tokens == 1 and sliding_window is None and n < 2 ** 31


def max_pool_blocks(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """The most KV blocks a pool may have for the kernel to apply (under 2^31 elements)."""
    return (2 ** 31 - 1) // (num_layers * block_size * num_kv_heads * head_dim)


def paged_decode_reference(q, k_pool, v_pool, layer, block_table, lengths, *, block_size: int):
    """The definition: gather every row's blocks of `layer`, mask positions >= lengths, softmax in fp32."""
    B, N, H = q.shape
    L, NS, K, _ = k_pool.shape
    NB = block_table.shape[1]
    S = NB * block_size
    slots = (block_table[:, :, None] * block_size + jnp.arange(block_size)[None, None, :]).reshape(B, S)
    k = k_pool[layer][slots].astype(jnp.float32)  # [B, S, K, H]
    v = v_pool[layer][slots].astype(jnp.float32)
    qg = q.reshape(B, K, N // K, H).astype(jnp.float32)
    scores = jnp.einsum("bkgh,bskh->bkgs", qg, k) * H ** -0.5
    valid = jnp.arange(S)[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.where(valid[:, None, None, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1) * jnp.any(valid, axis=1)[:, None, None, None]
    return jnp.einsum("bkgs,bskh->bkgh", probs, v).reshape(B, N, H).astype(q.dtype)


def _kernel(q_ref, k_ref, v_ref, table_ref, len_ref, o_ref, m_ref, l_ref, *, block_size: int, blocks_per_iter: int,
            scale: float):
    """One program: (row b, kv head, partition p). q_ref [Gp, H]; k_ref/v_ref [L * NBLK, bs, H] (this kv
    head's column of the whole pool); table_ref [NBp] (this partition's block ids, already offset to the
    layer); len_ref [1]. Writes the partition's unnormalised output [Gp, H], running max and sum [Gp]."""
    p = pl.program_id(2)
    nbp = table_ref.shape[0]
    chunk = blocks_per_iter * block_size
    length = len_ref[0]
    first = p * nbp  # the partition's first block of the row
    n_blocks = jnp.clip(pl.cdiv(length, block_size) - first, 0, nbp)  # real blocks in this partition
    q = q_ref[...]
    gp, h = q.shape

    def body(i, carry):
        o, m, l = carry
        blocks = table_ref[pl.ds(i * blocks_per_iter, blocks_per_iter)]
        k = k_ref[blocks].reshape(chunk, h).astype(q.dtype)
        v = v_ref[blocks].reshape(chunk, h).astype(q.dtype)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # [Gp, chunk]
        pos = (first + i * blocks_per_iter) * block_size + jnp.arange(chunk)
        s = jnp.where((pos < length)[None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new[:, None])
        l = corr * l + e.sum(axis=1)
        o = corr[:, None] * o + jnp.dot(e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o, m_new, l

    init = (jnp.zeros((gp, h), jnp.float32), jnp.full((gp,), _MASKED, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(n_blocks, blocks_per_iter), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("block_size", "partitions", "interpret", "num_warps", "num_stages"))
def paged_decode_attention(q, k_pool, v_pool, layer, block_table, lengths, *, block_size: int,
                           partitions: int | None = None, interpret: bool | None = None, num_warps: int = 4,
                           num_stages: int = 2):
    """See the module docstring. partitions: P (default: enough for ~MIN_PROGRAMS programs, at most one per
    BLOCKS_PER_ITER blocks of the table); interpret: None = on any backend but GPU."""
    B, N, H = q.shape
    L, NS, K, _ = k_pool.shape
    G = N // K
    bs = block_size
    nblk = NS // bs
    if NS % bs or N % K:
        raise ValueError(f"paged_decode_attention: pool slots {NS} must be a multiple of block_size {bs} and "
                         f"query heads {N} of kv heads {K}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    NB = block_table.shape[1]
    it = BLOCKS_PER_ITER
    if partitions is None:
        partitions = max(1, min(-(-MIN_PROGRAMS // (B * K)), -(-NB // it)))
    P = partitions
    nbp = -(-NB // (P * it)) * it  # blocks per partition, a multiple of the blocks per iteration
    table = block_table.astype(jnp.int32) + layer * nblk  # block ids in the [L * NBLK] view of the pool
    table = jnp.pad(table, ((0, 0), (0, P * nbp - NB))).reshape(B, P, nbp)
    gp = max(MIN_QUERY_ROWS, 1 << (G - 1).bit_length())
    qg = jnp.pad(q.reshape(B, K, G, H), ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    kp = k_pool.reshape(L * nblk, bs, K, H)
    vp = v_pool.reshape(L * nblk, bs, K, H)
    kernel = functools.partial(_kernel, block_size=bs, blocks_per_iter=it, scale=H ** -0.5)
    pool_spec = pl.BlockSpec((L * nblk, bs, None, H), lambda b, k, p: (0, 0, k, 0))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, P),
        in_specs=[pl.BlockSpec((None, None, gp, H), lambda b, k, p: (b, k, 0, 0)), pool_spec, pool_spec,
                  pl.BlockSpec((None, None, nbp), lambda b, k, p: (b, p, 0)),
                  pl.BlockSpec((1,), lambda b, k, p: (b,))],
        out_specs=[pl.BlockSpec((None, None, None, gp, H), lambda b, k, p: (b, k, p, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, k, p: (b, k, p, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, k, p: (b, k, p, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, P, gp, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, P, gp), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, P, gp), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params,
        name="paged_decode_attention",
    )(qg, kp, vp, table, lengths.astype(jnp.int32))
    # merge the partitions (an empty one has m = _MASKED, l = 0, o = 0)
    m_all = m.max(axis=2, keepdims=True)  # [B, K, 1, gp]
    w = jnp.exp(m - m_all)  # [B, K, P, gp]
    total = (l * w).sum(axis=2)  # [B, K, gp]
    out = (o * w[..., None]).sum(axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :, :G].reshape(B, N, H).astype(q.dtype)


_prepared: set[str] = set()


def prepare() -> None:
    """Lower a tiny call once per backend before the first real trace. Pallas imports its lowering modules
    lazily, on the first lowering, and they add jax config state: a jitted step traced before that would not
    share its cache with one traced after (one more compile of every serving shape)."""
    backend = jax.default_backend()
    if backend in _prepared:
        return
    q = jax.ShapeDtypeStruct((1, 1, 16), jnp.float32)
    pool = jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.float32)
    i32 = jnp.int32
    jax.jit(functools.partial(paged_decode_attention, block_size=16)).lower(
        q, pool, pool, jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((1, 1), i32),
        jax.ShapeDtypeStruct((1,), i32))
    _prepared.add(backend)


__all__ = ["kernel_applies", "max_pool_blocks", "paged_decode_attention", "paged_decode_reference", "prepare"]
