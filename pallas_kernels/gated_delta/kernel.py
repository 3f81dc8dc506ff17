"""The chunked gated delta rule's forward as one Pallas (Triton) kernel: one program per (row, head, block of BV
value columns) walks the row's chunks in order, the fp32 state [Dk, BV] in registers. The algorithm and the
packed-row masks are chunked.py's (its module docstring); per chunk the program does

    gamma = cumsum(g);  D_ij = exp(gamma_i - gamma_j) for j <= i in the same segment
    A     = beta_i D_ij (k_i . k_j)  (j < i);   T = (I + A)^-1 by forward substitution, one row per step
    U     = T (beta V);   W = T (beta exp(gamma) K)   (W only for tokens that read the carried state)
    u     = U - W S;   o = scale (exp(gamma) Q S + (QK^T * D) u);   S = exp(gamma_last) S + (K exp(..))^T u

The value columns of the state evolve independently (each column of S sees the same k, g, beta), so a program
owns BV of them: more programs than (row, head) alone, at the cost of recomputing the chunk's T per column block.

    q, k [B, Tp, H, Dk], v [B, Tp, H, Dv], g, beta [B, Tp, H] (fp32), seg [B, Tp] int32 (segment numbers),
    before [B, N] int32 (the segment number preceding each chunk), state [B, H, Dk, Dv] fp32
        -> o [B, Tp, H, Dv] (v's dtype), final state [B, H, Dk, Dv] fp32

Tp is a multiple of CHUNK, Dk and Dv powers of two (api.py pads). Matmuls are fp32 dots (Triton's IEEE fp32 on a
GPU). `gated_delta_pallas` takes every knob explicitly; api.chunk_gated_delta_rule is the public entry.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower-triangular [C, C] a, by forward substitution: row i of the inverse is
    e_i - sum_{j<i} a_ij row_j. Rows are picked and written through masks (no slicing of register values)."""
    c = a.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)

    def row(i, inv):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # [C]: a_ij, zero for j >= i
        new = jnp.where(col == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * inv, axis=0)
        return jnp.where(rows == i, new[None, :], inv)

    return jax.lax.fori_loop(0, c, row, jnp.zeros((c, c), jnp.float32))


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, before_ref, s0_ref, o_ref, s_ref, *, chunk: int,
            scale: float):
    """One program: q_ref, k_ref [Tp, Dk], v_ref, o_ref [Tp, BV], g_ref, beta_ref, seg_ref [Tp], before_ref [N],
    s0_ref, s_ref [Dk, BV]."""
    n_chunks = before_ref.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    t = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    f32 = jnp.float32

    def body(c, state):
        tok = pl.ds(c * chunk, chunk)
        q = q_ref[tok, :].astype(f32)
        k = k_ref[tok, :].astype(f32)
        v = v_ref[tok, :].astype(f32)
        g = g_ref[tok]
        beta = beta_ref[tok]
        seg = seg_ref[tok]
        first = (seg == before_ref[pl.ds(c, 1)]).astype(f32)  # [C]: reads the carried state
        last_seg = seg_ref[pl.ds(c * chunk + chunk - 1, 1)]
        last = (seg == last_seg).astype(f32)  # [C]: writes the state handed on
        gamma = jnp.cumsum(g)
        gamma_last = jnp.sum(g)
        same = seg[:, None] == seg[None, :]
        causal = (i >= j) & same
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        a = jnp.where((i > j) & same, beta[:, None] * decay * _dot(k, k.T), 0.0)
        inv = _unit_lower_inverse(a)
        u0 = _dot(inv, beta[:, None] * v)
        w = _dot(inv, (beta * jnp.exp(gamma) * first)[:, None] * k)
        u = u0 - _dot(w, state)
        attn = _dot(q, k.T) * decay * scale
        q_read = q * (jnp.exp(gamma) * first * scale)[:, None]
        o_ref[tok, :] = (_dot(q_read, state) + _dot(attn, u)).astype(o_ref.dtype)
        k_write = k * (jnp.exp(gamma_last - gamma) * last)[:, None]
        carry = jnp.exp(gamma_last) * jnp.sum(jnp.where(t == chunk - 1, first, 0.0))
        return carry * state + _dot(k_write.T, u)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(f32))


def gated_delta_pallas(q, k, v, g, beta, seg, before, state, *, scale: float, chunk: int, block_v: int,
                       num_warps: int, num_stages: int, interpret: bool):
    """The kernel over a grid (B, H, Dv / block_v). Shapes: the module docstring."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    N = Tp // chunk
    bv = block_v

    qk_spec = pl.BlockSpec((None, Tp, None, Dk), lambda b, h, c: (b, 0, h, 0))  # the program's row and head
    v_spec = pl.BlockSpec((None, Tp, None, bv), lambda b, h, c: (b, 0, h, c))  # ... and value columns

    scalars = pl.BlockSpec((None, Tp, None), lambda b, h, c: (b, 0, h))
    state_spec = pl.BlockSpec((None, None, Dk, bv), lambda b, h, c: (b, h, 0, c))
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, scale=scale),
        grid=(B, H, Dv // bv),
        in_specs=[qk_spec, qk_spec, v_spec, scalars, scalars,
                  pl.BlockSpec((None, Tp), lambda b, h, c: (b, 0)), pl.BlockSpec((None, N), lambda b, h, c: (b, 0)),
                  state_spec],
        out_specs=[v_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="chunk_gated_delta_rule_fwd",
    )(q, k, v, g, beta, seg, before, state)


__all__ = ["gated_delta_pallas"]
