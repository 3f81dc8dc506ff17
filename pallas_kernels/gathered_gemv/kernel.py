"""The gathered GEMV: y [A, O], y[a] = x[a] [I] @ w[expert_ids[a]] [I, O], each routed expert's weight read in
place from the stacked w [E, I, O] (no gathered [A, I, O] copy), one Pallas kernel (Triton lowering on GPU,
`interpret=True` elsewhere).

    grid (cdiv(O, bo), A)     program (j, a) owns output columns [j bo, (j+1) bo) of row a
    e = base + expert_ids[a]  (base: layer x E when w is a layer stack [L E, I, O] read in place; else 0)
    loop over I in steps of bi: load the weight tile w[e, i:i+bi, j bo:(j+1) bo] (bi runs of bo contiguous
                          values: coalesced along O) and x[a, i:i+bi]; acc [bi, bo] += x[:, None] * w in fp32
    epilogue: acc summed over its bi rows once, cast to x's dtype, stored

Grid axis 0 (fastest) is the column tile, so the programs of one row run side by side over one expert's
contiguous rows. An expert routed by several rows is read once per row, as the XLA gather does.

Math (pallas_kernels.grouped_matmul.gathered.rowwise_dot's): w is cast to x's dtype, then to fp32; products and
sums in fp32 (elementwise FMA, no tensor-core dot: at one row a program has no second row to share a dot with,
and an fp32 w is not rounded to TF32); y cast to x's dtype. Only the summation order differs from XLA's.

Shapes: bi and bo are powers of 2 (Triton) >= MIN_BLOCK; I and O need not be multiples of them (the last tiles
load with a mask, other = 0, and store with one). The ids must lie in [0, E): the kernel clamps them there so it
never reads outside the expert stack (the XLA gather gives NaN rows for an id out of range). Serving only: no
gradient (pallas_kernels.grouped_matmul.gathered wraps it with the XLA path's backward).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class GatheredTiles:
    """bi: contraction (I) values per loop step; bo: output columns per program (the weight tile is [bi, bo]);
    Triton's num_warps / num_stages. Measured on an H100 (session 28, `benchmarks/moe_decode.py --quant '' --rows 1,8
    --paths gather,gather_pallas --gather-tiles ...`, one MoE layer of Qwen3-30B-A3B in bf16, us at 1 / 8 rows):
    bi 256 bo 64 8 warps 53.1 / 227 (XLA's gather 62.4 / 228); bi 128 bo 64 8 warps 72.7 / 238; bi 128 bo 128
    72.5 / 237; bi 64 bo 64 4 warps 111 / 251; bi 64 bo 128 107 / 241. Triton does not pipeline these loads through
    shared memory (no dot consumes them), so a program has about one tile in flight: the larger tile keeps more
    bytes in flight per program (a [256, 64] bf16 tile is 32 KB in 128-byte rows). The fp32 accumulator [bi, bo]
    is bi bo / (32 num_warps) = 64 registers a thread at 8 warps."""

    bi: int = 256
    bo: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def label(self) -> str:
        return f"bi{self.bi}-bo{self.bo}-w{self.num_warps}-s{self.num_stages}"


def _pow2_at_most(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _next_pow2(v: int) -> int:
    return 1 << (max(v, 1) - 1).bit_length()


def fit(tiles: GatheredTiles, i_dim: int, o_dim: int) -> GatheredTiles:
    """tiles with bi and bo powers of 2 >= MIN_BLOCK, no larger than I and O rounded up to a power of 2."""
    bi = max(MIN_BLOCK, min(_pow2_at_most(tiles.bi), _next_pow2(i_dim)))
    bo = max(MIN_BLOCK, min(_pow2_at_most(tiles.bo), _next_pow2(o_dim)))
    return dataclasses.replace(tiles, bi=bi, bo=bo)


def _gathered_kernel(base_ref, ids_ref, x_ref, w_ref, y_ref, *, num_experts: int, i_dim: int, o_dim: int,
                     bi: int, bo: int):
    """Program (column tile j, row a): y[a, j bo:(j+1) bo] (module docstring)."""
    j, a = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32
    dt = x_ref.dtype
    e = base_ref[0] + jnp.clip(ids_ref[a], 0, num_experts - 1)
    o0 = pl.multiple_of(j * bo, bo)
    col_ok = (o0 + jnp.arange(bo, dtype=jnp.int32)) < o_dim  # [bo]
    mask_i, mask_o = i_dim % bi != 0, o_dim % bo != 0

    def step(t, acc):
        i0 = pl.multiple_of(t * bi, bi)
        x_tile = x_ref.at[a, pl.ds(i0, bi)]
        w_tile = w_ref.at[e, pl.ds(i0, bi), pl.ds(o0, bo)]
        if mask_i or mask_o:
            row_ok = (i0 + jnp.arange(bi, dtype=jnp.int32)) < i_dim  # [bi]
            x = plgpu.load(x_tile, mask=row_ok, other=0) if mask_i else x_tile[...]
            w = plgpu.load(w_tile, mask=row_ok[:, None] & col_ok[None, :], other=0)
        else:
            x, w = x_tile[...], w_tile[...]
        return acc + x.astype(f32)[:, None] * w.astype(dt).astype(f32)  # [bi, bo]

    acc = jax.lax.fori_loop(0, pl.cdiv(i_dim, bi), step, jnp.zeros((bi, bo), f32))
    y = jnp.sum(acc, axis=0).astype(y_ref.dtype)  # [bo]
    out = y_ref.at[a, pl.ds(o0, bo)]
    if mask_o:
        plgpu.store(out, y, mask=col_ok)
    else:
        out[...] = y


@functools.partial(jax.jit, static_argnames=("num_experts", "tiles", "interpret"))
def gathered_gemv_kernel(x: jax.Array, w: jax.Array, expert_ids: jax.Array, base: jax.Array, *, num_experts: int,
                         tiles: GatheredTiles, interpret: bool = False) -> jax.Array:
    """y [A, O] in x's dtype: y[a] = x[a] @ w[base + expert_ids[a]]. x [A, I] (float), w [R, I, O] (any float
    dtype; R = E, or L E for a layer stack with base = layer E), expert_ids [A] int, base [1] int32. tiles must be
    powers of 2 (`fit`)."""
    a_dim, i_dim = x.shape
    r, wi, o_dim = w.shape
    if wi != i_dim or expert_ids.shape != (a_dim,) or r % num_experts:
        raise ValueError(f"gathered GEMV: x {x.shape} [A, I], w {w.shape} [R, I, O] of {num_experts} experts a "
                         f"layer, expert_ids {expert_ids.shape} [A]")
    bi, bo = tiles.bi, tiles.bo
    if bi < MIN_BLOCK or bo < MIN_BLOCK or bi & (bi - 1) or bo & (bo - 1):
        raise ValueError(f"gathered GEMV tiles {tiles.label()}: bi and bo must be powers of 2 >= {MIN_BLOCK}")
    kernel = functools.partial(_gathered_kernel, num_experts=num_experts, i_dim=i_dim, o_dim=o_dim, bi=bi, bo=bo)
    params = None if interpret else plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((a_dim, o_dim), x.dtype),
                          grid=(pl.cdiv(o_dim, bo), a_dim), compiler_params=params, interpret=interpret,
                          name="gathered_gemv")(base.astype(jnp.int32), expert_ids.astype(jnp.int32), x, w)


__all__ = ["MIN_BLOCK", "GatheredTiles", "fit", "gathered_gemv_kernel"]
