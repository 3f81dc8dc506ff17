"""The decode GEMV's tensor-core body (GemvTiles.dot): y [M, N_out] = x [M, K] @ W^T for up to MAX_DOT_ROWS rows,
W [N, K] read in place from its layer stack, the same fused prologue / epilogues as kernel.py's FMA body.

    M_pad = M rounded up to a power of 2 >= 16 (tl.dot's least M); the x rows past M load as 0 (masked) and are
            not stored, so the caller pads nothing
    grid (N_out / bn,)   program j owns output columns [j bn, (j+1) bn) of every row
    loop over K in steps of bk: x tile [M_pad, bk] (normalised by the prologue, in dt), weight tile [bn, bk] from
                          rows layer n + j bn.. of the stack, acc [M_pad, bn] fp32 += x @ w^T (one tl.dot; a
                          gated weight: a second tile from the up rows and a second acc)
    epilogue: fused_ops.finish on acc, stored for the M real rows

Why. Above 8 rows the FMA body's per-row accumulators do not fit (each row keeps bn fp32 sums, unrolled), and XLA's
einsum on a layer of the stack copies the layer out first (a weight-sized copy per linear and step). A dot's
operands are also loads Triton software-pipelines (num_stages buffers in shared memory), which the FMA body's plain
loads are not, so the dot form may stream the weight faster even at M <= 8 (16 padded rows; measured by
benchmarks/decode_gemv.py). Each program re-reads x [M, K] from L2: x traffic is M_pad / bn times the weight's,
which bounds how small bn should be at 64 rows.

Roundings as reference.py: products of dt operands summed in fp32 (fp32 operands: precision HIGHEST, IEEE fp32 on
the GPU, not TF32), the output and each epilogue op rounded to dt (fused_ops).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_gemv.fused_ops import finish, normalise, operands

MAX_DOT_ROWS = 64   # rows per call of the dot body (acc [M_pad, bn] fp32, two when gated)
MIN_DOT_ROWS = 16   # tl.dot's least M: fewer rows are padded to it
MIN_DOT_BN = 16     # tl.dot's least N


def padded_rows(m: int) -> int:
    """M rounded up to a power of 2 >= MIN_DOT_ROWS."""
    return max(MIN_DOT_ROWS, 1 << (m - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class PaddedRows:
    """The M real rows of an M_pad-row tile (the dot bodies': this one's and quant_kernel.py's): loads give 0 past
    M, stores write the M rows only."""

    m: int

    @property
    def m_pad(self) -> int:
        return padded_rows(self.m)

    def _tile(self, ref, cols):
        return ref.at[pl.ds(0, self.m_pad), cols]

    def _ok(self):
        return (jnp.arange(self.m_pad, dtype=jnp.int32) < self.m)[:, None]  # [M_pad, 1]

    def load(self, ref, cols):
        """ref's first M_pad rows on `cols`, the rows past M as 0."""
        tile = self._tile(ref, cols)
        return tile[...] if self.m == self.m_pad else plgpu.load(tile, mask=self._ok(), other=0)

    def store(self, ref, cols, y):
        tile = self._tile(ref, cols)
        if self.m == self.m_pad:
            tile[...] = y
        else:
            plgpu.store(tile, y, mask=self._ok())

    def rstd(self, x_ref, k: int, chunk: int, eps: float):
        """Each row's 1 / rms over its K = k values of x_ref, summed in chunks of `chunk` -> [M_pad, 1] fp32."""
        f32 = jnp.float32

        def sum_sq(t, sums):
            x = self.load(x_ref, pl.ds(pl.multiple_of(t * chunk, chunk), chunk)).astype(f32)
            return sums + jnp.sum(jnp.square(x), axis=1, keepdims=True)

        return jax.lax.rsqrt(jax.lax.fori_loop(0, k // chunk, sum_sq, jnp.zeros((self.m_pad, 1), f32)) / k + eps)


def gemv_dot_kernel(layer_ref, x_ref, w_ref, *refs, m: int, n: int, half: int, bn: int, bk: int, n_k: int,
                    norm: str | None, eps: float, activation: str | None, residual: bool, round_output: bool):
    """One program: output columns [j bn, (j+1) bn) of the M rows (module docstring). n: the weight's rows per
    layer (its N); half: the up rows' offset in a gated weight (0: not gated)."""
    nw, r_ref, y_ref = operands(refs, norm=norm, residual=residual, k=n_k * bk)
    dt = x_ref.dtype
    f32 = jnp.float32
    tile = PaddedRows(m)
    j = pl.program_id(0)
    row0 = layer_ref[0] * n + j * bn
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None

    def k_cols(t):
        return pl.ds(pl.multiple_of(t * bk, bk), bk)

    rstd = tile.rstd(x_ref, n_k * bk, bk, eps) if norm else None

    def dot(x, w_rows, cols):  # x [M_pad, bk] @ w [bn, bk]^T -> [M_pad, bn] fp32
        w = w_ref[w_rows, cols].astype(dt)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=f32)

    gated = half > 0

    def step(t, accs):
        cols = k_cols(t)
        x = tile.load(x_ref, cols)
        if norm:
            x = normalise(x, rstd, nw(t, bk), norm, dt)
        gate = accs[0] + dot(x, pl.ds(row0, bn), cols)
        return (gate, accs[1] + dot(x, pl.ds(row0 + half, bn), cols)) if gated else (gate,)

    accs = jax.lax.fori_loop(0, n_k, step, tuple(jnp.zeros((tile.m_pad, bn), f32) for _ in range(1 + gated)))
    out_cols = pl.ds(j * bn, bn)
    r = tile.load(r_ref, out_cols) if residual else None
    y = finish(accs[0], accs[1] if gated else None, r, activation=activation, dt=dt, round_output=round_output)
    tile.store(y_ref, out_cols, y.astype(y_ref.dtype))


__all__ = ["MAX_DOT_ROWS", "MIN_DOT_BN", "MIN_DOT_ROWS", "PaddedRows", "gemv_dot_kernel", "padded_rows"]
