"""Grouped matmul kernels for dropless MoE (Pallas, Triton lowering on GPU; `interpret=True` elsewhere).

    gmm   y [A, O] = x [A, I] @ w[e] [I, O] for the rows of group e   grid (O/tn, V), loop over I in tiles of tk
          (transpose_rhs: y [A, I'] = x [A, O'] @ w[e]^T, w [E, I', O'], the input gradient of gmm)
    tgmm  dw [E, I, O], dw[e] = x_e^T [I, A_e] @ dy_e [A_e, O]          grid (O/to, I/ti, E), loop over the
          group's row tiles of tm

gmm walks the tile schedule (schedule.py): visit v multiplies row tile visit_tile[v] of x by w[visit_group[v]]
and stores only that group's rows (a masked store), so a tile straddling a boundary is computed once per group
it touches; the zero-tail visits store zeros, inactive visits do nothing. The rows of x are not masked on
load: a row outside the group only produces an output row that is not stored. tgmm owns one [ti, to] tile of
one expert's dw per program and loops over the tiles of that expert's rows, loading x and dy with a row mask
(other = 0), so an empty group's dw is 0.

Launch order: Triton runs grid axis 0 fastest. gmm's axis 0 is the output column tile, so the O/tn programs that
share a row tile of x run side by side (x read about once from HBM), and consecutive visits mostly share a group
(its w[e] stays in L2). tgmm's axes 0, 1 are dw's tiles of one expert, which then share that expert's rows.

All tile sizes are powers of 2 >= 16 (Triton's dot); I and O must be multiples of the tiles (`fit_gmm_tiles` /
`fit_tgmm_tiles` shrink a tile to a divisor); A is padded up to tm. Accumulation in fp32, inputs cast to x's
dtype (bf16 on the GPU path; an fp32 dot on the GPU uses Triton's default input precision, TF32).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_matmul.schedule import group_bounds, make_schedule


@dataclasses.dataclass(frozen=True)
class GmmTiles:
    """gmm's tiles: tm rows of x per visit, tk of the contraction (I) per loop step, tn output columns per
    program; num_warps / num_stages: Triton's launch and software-pipelining parameters."""

    tm: int = 128
    tk: int = 64
    tn: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def label(self) -> str:
        return f"tm{self.tm}-tk{self.tk}-tn{self.tn}-w{self.num_warps}-s{self.num_stages}"


@dataclasses.dataclass(frozen=True)
class TgmmTiles:
    """tgmm's tiles: tm rows (the contraction) per loop step, a [ti, to] tile of dw[e] per program."""

    tm: int = 64
    ti: int = 128
    to: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def label(self) -> str:
        return f"tm{self.tm}-ti{self.ti}-to{self.to}-w{self.num_warps}-s{self.num_stages}"


def _pow2(v: int) -> bool:
    return v >= 16 and not v & (v - 1)


def _fit(tile: int, dim: int, name: str) -> int:
    """The largest power of 2 <= tile (and >= 16) dividing dim; ValueError if none."""
    t = tile
    while t > 16 and dim % t:
        t //= 2
    if dim % t:
        raise ValueError(f"grouped_matmul: dimension {dim} has no power-of-2 tile >= 16 dividing it ({name})")
    return t


def _check_tiles(sizes: dict[str, int], num_warps: int, num_stages: int) -> None:
    """A bad tile or launch parameter is a ValueError naming it."""
    for name, v in sizes.items():
        if not isinstance(v, int) or not _pow2(v):
            raise ValueError(f"grouped_matmul: tile {name}={v!r} must be a power of 2 >= 16 (Triton)")
    for name, v in (("num_warps", num_warps), ("num_stages", num_stages)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"grouped_matmul: {name}={v!r}, expected a positive int")


def fit_gmm_tiles(tiles: GmmTiles, rows: int, k: int, n: int) -> GmmTiles:
    """tk, tn shrunk to divisors of the contraction k and the output width n; tm to a small A's power of 2."""
    _check_tiles(dict(tm=tiles.tm, tk=tiles.tk, tn=tiles.tn), tiles.num_warps, tiles.num_stages)
    tm = min(tiles.tm, max(16, 1 << (max(rows, 1) - 1).bit_length()))
    return dataclasses.replace(tiles, tm=tm, tk=_fit(tiles.tk, k, "tk"), tn=_fit(tiles.tn, n, "tn"))


def fit_tgmm_tiles(tiles: TgmmTiles, rows: int, i: int, o: int) -> TgmmTiles:
    """ti, to shrunk to divisors of I and O; tm to a small A's power of 2."""
    _check_tiles(dict(tm=tiles.tm, ti=tiles.ti, to=tiles.to), tiles.num_warps, tiles.num_stages)
    tm = min(tiles.tm, max(16, 1 << (max(rows, 1) - 1).bit_length()))
    return dataclasses.replace(tiles, tm=tm, ti=_fit(tiles.ti, i, "ti"), to=_fit(tiles.to, o, "to"))


def _compiler_params(num_warps: int, num_stages: int, interpret: bool):
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _pad_rows(a: jax.Array, tm: int) -> jax.Array:
    pad = (-a.shape[0]) % tm
    return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _whole(shape) -> pl.BlockSpec:
    """The whole array as one block (the kernel indexes it itself)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _gmm_kernel(group_ref, tile_ref, start_ref, end_ref, x_ref, w_ref, y_ref, *, tm: int, tk: int, tn: int,
                n_k: int, num_groups: int, transpose_rhs: bool):
    """Program (column tile j, visit v): y[rows of the visit's group in its row tile, j's columns]."""
    j, v = pl.program_id(0), pl.program_id(1)
    g = group_ref[v]
    r0 = pl.multiple_of(tile_ref[v] * tm, tm)
    c0 = pl.multiple_of(j * tn, tn)
    gi = jnp.minimum(g, num_groups)  # the inactive visits' E + 1 clamped for the bounds lookup
    rows = r0 + jnp.arange(tm, dtype=jnp.int32)
    mine = jnp.broadcast_to(((rows >= start_ref[gi]) & (rows < end_ref[gi]))[:, None], (tm, tn))  # [tm, tn]
    out = y_ref.at[pl.ds(r0, tm), pl.ds(c0, tn)]

    @pl.when(g < num_groups)
    def _multiply():
        def step(k, acc):
            k0 = pl.multiple_of(k * tk, tk)
            x = x_ref[pl.ds(r0, tm), pl.ds(k0, tk)]  # [tm, tk]
            if transpose_rhs:
                w = w_ref[g, pl.ds(c0, tn), pl.ds(k0, tk)]  # [tn, tk]
                dims = ((1,), (1,))
            else:
                w = w_ref[g, pl.ds(k0, tk), pl.ds(c0, tn)]  # [tk, tn]
                dims = ((1,), (0,))
            return acc + jax.lax.dot_general(x, w.astype(x.dtype), (dims, ((), ())),
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((tm, tn), jnp.float32))
        plgpu.store(out, acc.astype(y_ref.dtype), mask=mine)

    @pl.when(g == num_groups)
    def _zero_tail():
        plgpu.store(out, jnp.zeros((tm, tn), y_ref.dtype), mask=mine)


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiles", "interpret"))
def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
        tiles: GmmTiles = GmmTiles(), interpret: bool = False) -> jax.Array:
    """y [A, O] = x [A, I] @ w[e] [I, O] per group (transpose_rhs: w [E, O, I], y = x @ w[e]^T); rows past
    sum(group_sizes) are 0. y in x's dtype. No validation of group_sizes beyond clipping at A."""
    a, k = x.shape
    e, wk, wn = w.shape
    k_w, n = (wn, wk) if transpose_rhs else (wk, wn)
    if k != k_w or group_sizes.shape != (e,):
        raise ValueError(f"gmm: x {x.shape}, w {w.shape} (transpose_rhs={transpose_rhs}), "
                         f"group_sizes {group_sizes.shape}")
    tiles = fit_gmm_tiles(tiles, a, k, n)
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    xp = _pad_rows(x, tm)
    sched = make_schedule(group_sizes, xp.shape[0], tm)
    v = sched.visit_group.shape[0]
    kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, n_k=k // tk, num_groups=e,
                               transpose_rhs=transpose_rhs)
    y = pl.pallas_call(
        kernel,
        grid=(n // tn, v),
        in_specs=[_whole((v,)), _whole((v,)), _whole((e + 1,)), _whole((e + 1,)), _whole(xp.shape),
                  _whole(w.shape)],
        out_specs=_whole((xp.shape[0], n)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), x.dtype),
        compiler_params=_compiler_params(tiles.num_warps, tiles.num_stages, interpret),
        interpret=interpret,
        name="gmm_t" if transpose_rhs else "gmm",
    )(sched.visit_group, sched.visit_tile, sched.starts, sched.ends, xp, w)
    return y[:a]


def _tgmm_kernel(start_ref, end_ref, x_ref, dy_ref, dw_ref, *, tm: int, ti: int, to: int):
    """Program (o tile, i tile, group e): dw[e][i tile, o tile] = sum over e's row tiles of x^T @ dy, masked."""
    o, i, e = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = start_ref[e], end_ref[e]
    i0 = pl.multiple_of(i * ti, ti)
    o0 = pl.multiple_of(o * to, to)
    first = lo // tm
    last = jnp.where(hi > lo, (hi + tm - 1) // tm, first)  # an empty group runs no step

    def step(t, acc):
        r0 = pl.multiple_of(t * tm, tm)
        rows = r0 + jnp.arange(tm, dtype=jnp.int32)
        mine = (rows >= lo) & (rows < hi)  # [tm]
        x = plgpu.load(x_ref.at[pl.ds(r0, tm), pl.ds(i0, ti)], mask=jnp.broadcast_to(mine[:, None], (tm, ti)),
                       other=0)  # [tm, ti]
        dy = plgpu.load(dy_ref.at[pl.ds(r0, tm), pl.ds(o0, to)], mask=jnp.broadcast_to(mine[:, None], (tm, to)),
                        other=0)  # [tm, to]
        return acc + jax.lax.dot_general(x, dy.astype(x.dtype), (((0,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(first, last, step, jnp.zeros((ti, to), jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "out_dtype"))
def tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, tiles: TgmmTiles = TgmmTiles(),
         interpret: bool = False, out_dtype=None) -> jax.Array:
    """dw [E, I, O]: dw[e] = x_e^T @ dy_e over group e's rows of x [A, I], dy [A, O] (E = group_sizes' length);
    an empty group's dw[e] is 0. dw in out_dtype (default x's)."""
    a, i_dim = x.shape
    if dy.shape[0] != a or group_sizes.ndim != 1:
        raise ValueError(f"tgmm: x {x.shape}, dy {dy.shape}, group_sizes {group_sizes.shape}")
    o_dim = dy.shape[1]
    e = group_sizes.shape[0]
    tiles = fit_tgmm_tiles(tiles, a, i_dim, o_dim)
    tm, ti, to = tiles.tm, tiles.ti, tiles.to
    xp, dyp = _pad_rows(x, tm), _pad_rows(dy, tm)
    starts, ends = group_bounds(group_sizes, a)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, ti=ti, to=to),
        grid=(o_dim // to, i_dim // ti, e),
        in_specs=[_whole((e,)), _whole((e,)), _whole(xp.shape), _whole(dyp.shape)],
        out_specs=pl.BlockSpec((None, ti, to), lambda o, i, g: (g, i, o)),
        out_shape=jax.ShapeDtypeStruct((e, i_dim, o_dim), out_dtype or x.dtype),
        compiler_params=_compiler_params(tiles.num_warps, tiles.num_stages, interpret),
        interpret=interpret,
        name="tgmm",
    )(starts, ends, xp, dyp)


__all__ = ["GmmTiles", "TgmmTiles", "fit_gmm_tiles", "fit_tgmm_tiles", "gmm", "tgmm"]
