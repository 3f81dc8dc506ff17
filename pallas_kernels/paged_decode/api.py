"""Paged decode attention, the public entry: one query token per row attends over its k/v blocks in the paged
pool, read in place through the block table by the Pallas kernel (`kernel.py`); `reference.py` is the
definition it is checked against.

    q [B, N, H] (N = K * G), pools k/v [L, NBLK * bs, K, H] (every layer), layer [] int32,
    block_table [B, NB], lengths [B] (positions to attend to, the new token's included) -> out [B, N, H]

On a GPU the kernel runs as Triton; on any other backend in Pallas interpret mode (tests). Softmax in fp32,
scale H ** -0.5, no sliding window; a row of length 0 (padding) gets zeros. Where the kernel does not apply
(`kernel_applies`: more than one query token per row, a sliding window, a pool of 2^31 slots or more) the caller
gathers instead. Pools past 2^31 elements are fine: Pallas' Triton lowering addresses an array of more than 4 GiB
with 64-bit offsets (jax 0.11); only the kernel's slot indices (block id x bs + offset) are int32.

Tuning knobs: keyword arguments of `paged_decode_attention` (described in `kernel.py`), defaulting to the
module constants below, the best configuration of benchmarks/paged_decode_sweep.py at every shape it timed
(the figures: benchmarks/RESULTS.md#s3-paged). `min_programs`: each row's context is split into partitions until the
grid has about this many programs (`num_partitions`). `merge`: the partitions merged by XLA ops ("xla") or by a
second Pallas kernel ("pallas", one launch in place of about five); "auto" (the default) takes "pallas" for calls
of at most MERGE_PALLAS_MAX_ROWS rows on a GPU: measured on an H100 in session 29 (Qwen3-0.6B shapes, 28 layers a
call), one row 12.4 us against 14.9 (context 576) and the engine at one user 632 against 598 tok/s, but 16 rows
27.6 against 26.2 us and 64 rows 61.5 against 58.7.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_decode.kernel import paged_decode_pallas

BLOCKS_PER_ITER = 1  # pool blocks per loop iteration of a program (bs keys per iteration)
MIN_PROGRAMS = 1024  # split each row's context until the grid has about this many programs
NUM_WARPS = 1
NUM_STAGES = 2
QK = "fma"
SPLIT = "length"
# how the P partitions are merged: "xla" (a handful of small XLA kernels after the Pallas call), "pallas" (one
# more pallas_call, grid (B, K); equal to "xla" in interpret mode) or "auto" (the module docstring)
MERGE = "auto"
MERGE_PALLAS_MAX_ROWS = 8  # auto: the Pallas merge up to this many rows (measured at 1 and 16: the docstring)
QK_MODES = ("dot", "fma")
SPLIT_MODES = ("table", "length")
MERGE_MODES = ("auto", "xla", "pallas")
MAX_POOL_SLOTS = 2 ** 31  # the kernel's slot indices into the [L * NBLK * bs] view of the pool are int32


def kernel_applies(pool_shape, num_query_tokens: int, sliding_window: int | None) -> bool:
    """The kernel serves one query token per row without a sliding window, over a pool [L, NBLK * bs, K, H]
    whose L * NBLK * bs slots have int32 indices; anything else takes the gather path."""
    return num_query_tokens == 1 and sliding_window is None and pool_shape[0] * pool_shape[1] < MAX_POOL_SLOTS


def max_pool_blocks(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """The most KV blocks a pool may have for the kernel to apply (under 2^31 slots over all layers;
    num_kv_heads and head_dim do not bound it: element offsets are 64-bit past 4 GiB)."""
    del num_kv_heads, head_dim
    return (MAX_POOL_SLOTS - 1) // (num_layers * block_size)


def num_partitions(batch: int, kv_heads: int, table_blocks: int, *, blocks_per_iter: int = BLOCKS_PER_ITER,
                   min_programs: int = MIN_PROGRAMS) -> int:
    """P: enough partitions per (row, kv head) for about `min_programs` programs, at most one per
    `blocks_per_iter` blocks of the table."""
    return max(1, min(-(-min_programs // (batch * kv_heads)), -(-table_blocks // blocks_per_iter)))


def _check_knobs(blocks_per_iter: int, min_programs: int, num_warps: int, num_stages: int, qk: str, split: str,
                 merge: str, block_size: int, interpret: bool) -> None:
    """A bad tuning knob is an error that names it and what was expected."""
    if merge not in MERGE_MODES:
        raise ValueError(f"paged_decode_attention: merge={merge!r}, expected one of {MERGE_MODES}")
    if qk not in QK_MODES:
        raise ValueError(f"paged_decode_attention: qk={qk!r}, expected one of {QK_MODES}")
    if split not in SPLIT_MODES:
        raise ValueError(f"paged_decode_attention: split={split!r}, expected one of {SPLIT_MODES}")
    for name, value in (("blocks_per_iter", blocks_per_iter), ("min_programs", min_programs),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"paged_decode_attention: {name}={value!r}, expected a positive int")
    chunk = blocks_per_iter * block_size
    if not interpret and chunk & (chunk - 1):
        raise ValueError(f"paged_decode_attention: blocks_per_iter {blocks_per_iter} x block_size {block_size} = "
                         f"{chunk} keys per iteration; Triton wants a power of two")


@functools.partial(jax.jit, static_argnames=("block_size", "partitions", "interpret", "blocks_per_iter",
                                             "min_programs", "num_warps", "num_stages", "qk", "split", "merge"))
def paged_decode_attention(q, k_pool, v_pool, layer, block_table, lengths, *, block_size: int,
                           partitions: int | None = None, interpret: bool | None = None,
                           blocks_per_iter: int = BLOCKS_PER_ITER, min_programs: int = MIN_PROGRAMS,
                           num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, qk: str = QK,
                           split: str = SPLIT, merge: str = MERGE):
    """Shapes: the module docstring. partitions: P (default `num_partitions`); interpret: None = on any backend
    but GPU. A knob out of range is a ValueError naming it."""
    B, N, H = q.shape
    _, NS, K, _ = k_pool.shape
    if NS % block_size or N % K:
        raise ValueError(f"paged_decode_attention: pool slots {NS} must be a multiple of block_size {block_size} "
                         f"and query heads {N} of kv heads {K}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    _check_knobs(blocks_per_iter, min_programs, num_warps, num_stages, qk, split, merge, block_size, interpret)
    if partitions is None:
        partitions = num_partitions(B, K, block_table.shape[1], blocks_per_iter=blocks_per_iter,
                                    min_programs=min_programs)
    if merge == "auto":
        merge = "pallas" if not interpret and B <= MERGE_PALLAS_MAX_ROWS else "xla"
    return paged_decode_pallas(q, k_pool, v_pool, layer, block_table, lengths, block_size=block_size,
                               partitions=partitions, interpret=interpret, blocks_per_iter=blocks_per_iter,
                               num_warps=num_warps, num_stages=num_stages, qk=qk, split=split, merge=merge)


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


__all__ = ["BLOCKS_PER_ITER", "MERGE", "MERGE_MODES", "MERGE_PALLAS_MAX_ROWS", "MIN_PROGRAMS", "NUM_STAGES",
           "NUM_WARPS", "QK", "QK_MODES", "SPLIT", "SPLIT_MODES",
           "kernel_applies", "max_pool_blocks", "num_partitions", "paged_decode_attention", "prepare"]
