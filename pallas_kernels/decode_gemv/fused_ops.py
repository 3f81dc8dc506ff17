"""The element-wise ops the decode GEMV fuses around its product, in the roundings of reference.py (the decoder's own
ops, each output rounded to dt = x's dtype as XLA rounds it), shared by both kernel bodies (kernel.py's FMA rows,
dot_kernel.py's tensor-core tile):

    normalise   the RMSNorm prologue on an x chunk, given each row's 1 / rms: "plain" scale.astype(dt) *
                normed.astype(dt) (Llama / Qwen), "zero_centered" (normed * (1 + w)) in fp32, then dt (Gemma)
    rows_rstd   the FMA bodies' RMSNorm statistics, one 1 / rms per row
    operands    the optional refs after x and w, as both bodies receive them: (norm weight chunk loader, residual,
                y); the norm weight is one row of a flattened [R K] (R = 1, or a layer stack's rows read in place)
    finish      the epilogue on the fp32 sums: the GEMV's output in dt (or the fp32 sums as they are: a tied LM
                head's logits), act(gate) * up of a joined [gate; up] weight (silu | gelu_tanh), + the residual
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def operands(refs, *, norm: str | None, residual: bool, k: int):
    """The refs after (layer, x, w) -> (norm weight loader or None, residual ref or None, output ref), in the order
    kernel.gemv passes them: with `norm`, the flattened norm weights [R K] and the row to read ([1] int32).
    The loader: (t, bk) -> the row's K chunk t of bk values."""
    refs = list(refs)
    nw = None
    if norm:
        nw_ref, row_ref = refs.pop(0), refs.pop(0)

        def nw(t, bk):
            return nw_ref[pl.ds(pl.multiple_of(row_ref[0] * k + t * bk, bk), bk)]
    r_ref = refs.pop(0) if residual else None
    return nw, r_ref, refs[0]


def rows_rstd(x_ref, m: int, k: int, chunk: int, eps: float) -> list:
    """The FMA bodies' prologue statistics: each of x_ref's first m rows' 1 / rms over its K = k values, summed in
    chunks of `chunk` (x is a few KB, read from L2: every program recomputes it). -> m fp32 scalars."""
    f32 = jnp.float32

    def sum_sq(t, sums):
        cols = pl.ds(pl.multiple_of(t * chunk, chunk), chunk)
        return tuple(s + jnp.sum(jnp.square(x_ref[i, cols].astype(f32))) for i, s in enumerate(sums))

    sums = jax.lax.fori_loop(0, k // chunk, sum_sq, tuple(jnp.zeros((), f32) for _ in range(m)))
    return [jax.lax.rsqrt(s / k + eps) for s in sums]


def normalise(x: jnp.ndarray, rstd: jnp.ndarray, nw: jnp.ndarray, norm: str, dt) -> jnp.ndarray:
    """x [..., bk] (dt) times rstd (broadcasting against x) and the norm weight chunk nw [bk] -> [..., bk] in dt."""
    f32 = jnp.float32
    if norm == "plain":  # scale.astype(dt) * normed.astype(dt): a product of two dt values, rounded
        normed = (x.astype(f32) * rstd).astype(dt).astype(f32)
        return (nw.astype(dt).astype(f32) * normed).astype(dt)
    return (x.astype(f32) * rstd * (1.0 + nw.astype(f32))).astype(dt)  # zero_centered: rounded once


def finish(acc: jnp.ndarray, acc_up: jnp.ndarray | None, r: jnp.ndarray | None, *, activation: str | None, dt,
           round_output: bool) -> jnp.ndarray:
    """The fp32 sums acc (and acc_up: the up half of a gated weight; r: the residual, any dtype) -> the output
    values in fp32, each holding a dt value (round_output False: acc unrounded, a plain GEMV's fp32 logits)."""
    rd = lambda v: v.astype(dt).astype(jnp.float32)  # noqa: E731  one rounding to dt, as each of the decoder's ops
    y = rd(acc) if round_output else acc  # the GEMV's output, in dt (or fp32)
    if acc_up is not None:
        act = silu(y, rd) if activation == "silu" else gelu_tanh(y, rd, dt)
        y = rd(act * rd(acc_up))
    if r is not None:
        y = y + r.astype(jnp.float32)
    return y


def silu(v, rd):
    """jax.nn.silu in dt as XLA runs it: v * (1 / (1 + exp(-v))), each op rounded (v fp32 holding a dt value)."""
    return rd(v * rd(1.0 / rd(1.0 + rd(jnp.exp(-v)))))


def gelu_tanh(v, rd, dt):
    """jax.nn.gelu(approximate=True) in dt, op by op: v * 0.5 (1 + tanh(c (v + 0.044715 v^3))), the constants
    in dt as jax casts them (v fp32 holding a dt value)."""
    c = float(np.asarray(np.sqrt(2 / np.pi)).astype(dt))
    a = float(np.asarray(0.044715).astype(dt))
    inner = rd(c * rd(v + rd(a * rd(rd(v * v) * v))))
    return rd(v * rd(0.5 * rd(1.0 + rd(jnp.tanh(inner)))))


__all__ = ["finish", "gelu_tanh", "normalise", "operands", "rows_rstd", "silu"]
