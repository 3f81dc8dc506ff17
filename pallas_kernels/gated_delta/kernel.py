"""The chunked gated delta rule as two Pallas (Triton) kernels, forward and backward: one program per (row, head,
block of BV value columns) walks the row's chunks, the fp32 state [Dk, BV] in registers. The algorithm and the
packed-row masks are chunked.py's (its module docstring); per chunk (`_chunk_terms`, shared by both kernels):

    gamma = cumsum(g);  D_ij = exp(gamma_i - gamma_j) for j <= i in the same segment
    A     = beta_i D_ij (k_i . k_j)  (j < i);   T = (I + A)^-1 by forward substitution, one row per step
    U     = T (beta V);   W = T (beta exp(gamma) K)   (W only for tokens that read the carried state)
    u     = U - W S;   o = scale (exp(gamma) Q S + (QK^T * D) u);   S = exp(gamma_last) S + (K exp(..))^T u

Forward (`gated_delta_pallas`): chunks in order; for training it also writes the state entering each chunk
[B, H, N, Dk, Dv] fp32 (fla's `h`). Backward (`gated_delta_pallas_bwd`): chunks in reverse, the chunk's terms
recomputed, the state's cotangent dS carried from the last chunk to the first; each program writes its column
block's share of dq, dk, dg, dbeta (summed afterwards: they see every value column) and its own dv, d initial state.

The value columns of the state evolve independently (each column of S sees the same k, g, beta), so a program
owns BV of them: more programs than (row, head) alone, at the cost of recomputing the chunk's T per column block.

    q, k [B, Tp, H, Dk], v [B, Tp, H, Dv], g, beta [B, Tp, H] (fp32), seg [B, Tp] int32 (segment numbers),
    before [B, N] int32 (the segment number preceding each chunk), state [B, H, Dk, Dv] fp32
        -> o [B, Tp, H, Dv] (v's dtype), final state [B, H, Dk, Dv] fp32

Tp is a multiple of CHUNK, Dk and Dv powers of two (api.py pads). Matmuls are fp32 dots at the default precision (TF32 on
a Hopper GPU, as the generated code shows; bf16 operands are a tuning step for the GPU session). The kernels take every knob explicitly;
api.chunk_gated_delta_rule is the public entry.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def unit_lower_inverse_rows(a):
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


def _chunk_terms(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, before_ref, c, *, chunk: int, scale: float):
    """Everything chunk c contributes that does not depend on the state entering it (the names of chunked.py's
    docstring; fp32)."""
    f32 = jnp.float32
    i = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    t = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    tok = pl.ds(c * chunk, chunk)
    q = q_ref[tok, :].astype(f32)
    k = k_ref[tok, :].astype(f32)
    v = v_ref[tok, :].astype(f32)
    g = g_ref[tok]
    beta = beta_ref[tok]
    seg = seg_ref[tok]
    first = (seg == before_ref[pl.ds(c, 1)]).astype(f32)  # [C]: reads the carried state
    last = (seg == seg_ref[pl.ds(c * chunk + chunk - 1, 1)]).astype(f32)  # [C]: writes the state handed on
    gamma = jnp.sum(jnp.where(i >= j, g[None, :], 0.0), axis=1)  # the chunk's cumulative log decay
    gamma_last = jnp.sum(g)
    same = seg[:, None] == seg[None, :]
    causal = (i >= j) & same
    strict = (i > j) & same
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    kk = _dot(k, k.T)
    inv = unit_lower_inverse_rows(jnp.where(strict, beta[:, None] * decay * kk, 0.0))
    eg = jnp.exp(gamma)
    r1 = beta[:, None] * v
    r2 = (beta * eg * first)[:, None] * k
    qk = _dot(q, k.T)
    ew = jnp.exp(gamma_last - gamma) * last
    return dict(q=q, k=k, v=v, beta=beta, first=first, i=i, j=j, strict=strict, gamma=gamma, decay=decay, kk=kk,
                inv=inv, eg=eg, r1=r1, r2=r2, u0=_dot(inv, r1), w=_dot(inv, r2), qk=qk,
                attn=qk * decay * scale, q_read=q * (eg * first * scale)[:, None], ew=ew, k_write=k * ew[:, None],
                carry=jnp.exp(gamma_last) * jnp.sum(jnp.where(t == chunk - 1, first, 0.0)))


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, before_ref, s0_ref, o_ref, s_ref, *states_ref,
            chunk: int, scale: float):
    """One program: q_ref, k_ref [Tp, Dk], v_ref, o_ref [Tp, BV], g_ref, beta_ref, seg_ref [Tp], before_ref [N],
    s0_ref, s_ref [Dk, BV]; states_ref (training): [N, Dk, BV], the state entering each chunk."""
    n_chunks = before_ref.shape[0]
    operands = (q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, before_ref)

    def body(c, state):
        x = _chunk_terms(*operands, c, chunk=chunk, scale=scale)
        if states_ref:
            states_ref[0][c] = state
        u = x["u0"] - _dot(x["w"], state)
        o_ref[pl.ds(c * chunk, chunk), :] = (_dot(x["q_read"], state) + _dot(x["attn"], u)).astype(o_ref.dtype)
        return x["carry"] * state + _dot(x["k_write"].T, u)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(jnp.float32))


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, before_ref, states_ref, do_ref, ds_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, ds0_ref, *, chunk: int, scale: float):
    """One program, chunks in reverse: the chunk's terms recomputed, the state entering it read from the forward's
    states_ref [N, Dk, BV]; do_ref [Tp, BV] and ds_ref [Dk, BV] the cotangents of o and of the final state.
    Writes dv [Tp, BV] and the state's cotangent ds0 [Dk, BV], and this column block's share of dq, dk [Tp, Dk],
    dg, dbeta [Tp] (summed over the blocks by the caller)."""
    n_chunks = before_ref.shape[0]
    operands = (q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, before_ref)

    def body(it, ds1):
        c = n_chunks - 1 - it
        tok = pl.ds(c * chunk, chunk)
        x = _chunk_terms(*operands, c, chunk=chunk, scale=scale)
        s0 = states_ref[c]
        do = do_ref[tok, :].astype(jnp.float32)
        q, k, v, beta, eg, inv = x["q"], x["k"], x["v"], x["beta"], x["eg"], x["inv"]
        first_eg = x["first"] * eg
        u = x["u0"] - _dot(x["w"], s0)
        # through o = q_read S0 + attn u and S1 = carry S0 + k_write^T u
        du = _dot(x["attn"].T, do) + _dot(x["k_write"], ds1)
        ds0 = _dot(x["q_read"].T, do) + x["carry"] * ds1 - _dot(x["w"].T, du)
        d_attn = _dot(do, u.T)
        d_qread = _dot(do, s0.T)
        d_kwrite = _dot(u, ds1.T)
        d_carry = jnp.sum(jnp.sum(s0 * ds1, axis=1))  # one axis at a time (a 2-D sum fails to lower)
        # through u = U0 - W S0, U0 = T r1, W = T r2, T = (I + A)^-1
        dw = -_dot(du, s0.T)
        dr1 = _dot(inv.T, du)
        dr2 = _dot(inv.T, dw)
        d_inv = _dot(du, x["r1"].T) + _dot(dw, x["r2"].T)
        da = jnp.where(x["strict"], -_dot(_dot(inv.T, d_inv), inv.T), 0.0)
        # through attn = qk D scale and A = beta_i D_ij kk_ij
        d_qk = d_attn * x["decay"] * scale
        d_kk = da * beta[:, None] * x["decay"]
        d_decay = d_attn * x["qk"] * scale + da * beta[:, None] * x["kk"]
        m = d_decay * x["decay"]  # d/d(gamma_i - gamma_j)
        dr2_k = jnp.sum(dr2 * k, axis=1)
        d_ew = jnp.sum(d_kwrite * k, axis=1) * x["ew"]
        d_gamma = (jnp.sum(m, axis=1) - jnp.sum(m, axis=0) + jnp.sum(d_qread * q, axis=1) * first_eg * scale
                   + dr2_k * beta * first_eg - d_ew)
        d_gamma_last = jnp.sum(d_ew) + d_carry * x["carry"]
        dq_ref[tok, :] = _dot(d_qk, k) + d_qread * (first_eg * scale)[:, None]
        dk_ref[tok, :] = (_dot(d_qk.T, q) + _dot(d_kk + d_kk.T, k) + dr2 * (beta * first_eg)[:, None]
                          + d_kwrite * x["ew"][:, None])
        dv_ref[tok, :] = (dr1 * beta[:, None]).astype(dv_ref.dtype)
        dbeta_ref[tok] = jnp.sum(da * x["decay"] * x["kk"], axis=1) + jnp.sum(dr1 * v, axis=1) + dr2_k * first_eg
        dg_ref[tok] = jnp.sum(jnp.where(x["i"] >= x["j"], d_gamma[:, None], 0.0), axis=0) + d_gamma_last
        return ds0

    ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, body, ds_ref[...].astype(jnp.float32))


def gated_delta_pallas(q, k, v, g, beta, seg, before, state, *, scale: float, chunk: int, block_v: int,
                       num_warps: int, num_stages: int, interpret: bool, save_states: bool = False):
    """The forward kernel over a grid (B, H, Dv / block_v): (o, final state), and with save_states the state
    entering each chunk [B, H, N, Dk, Dv] fp32 (the backward's input). Shapes: the module docstring."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    N = Tp // chunk
    bv = block_v
    qk_spec = pl.BlockSpec((None, Tp, None, Dk), lambda b, h, c: (b, 0, h, 0))  # the program's row and head
    v_spec = pl.BlockSpec((None, Tp, None, bv), lambda b, h, c: (b, 0, h, c))  # ... and value columns
    scalars = pl.BlockSpec((None, Tp, None), lambda b, h, c: (b, 0, h))
    state_spec = pl.BlockSpec((None, None, Dk, bv), lambda b, h, c: (b, h, 0, c))
    out_specs = [v_spec, state_spec]
    out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)]
    if save_states:
        out_specs.append(pl.BlockSpec((None, None, N, Dk, bv), lambda b, h, c: (b, h, 0, 0, c)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, N, Dk, Dv), jnp.float32))
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, scale=scale),
        grid=(B, H, Dv // bv),
        in_specs=[qk_spec, qk_spec, v_spec, scalars, scalars, pl.BlockSpec((None, Tp), lambda b, h, c: (b, 0)),
                  pl.BlockSpec((None, N), lambda b, h, c: (b, 0)), state_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="chunk_gated_delta_rule_fwd",
    )(q, k, v, g, beta, seg, before, state)


def gated_delta_pallas_bwd(q, k, v, g, beta, seg, before, states, do, ds, *, scale: float, chunk: int,
                           block_v: int, num_warps: int, num_stages: int, interpret: bool):
    """The backward kernel over the same grid: the forward's operands, its saved states [B, H, N, Dk, Dv], the
    cotangents do [B, Tp, H, Dv] and ds [B, H, Dk, Dv] -> (dq, dk, dv, dg, dbeta, d initial state), dq / dk / dg /
    dbeta fp32 (each column block's share summed here), dv in v's dtype."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    N = Tp // chunk
    bv = block_v
    nv = Dv // bv
    qk_spec = pl.BlockSpec((None, Tp, None, Dk), lambda b, h, c: (b, 0, h, 0))
    v_spec = pl.BlockSpec((None, Tp, None, bv), lambda b, h, c: (b, 0, h, c))
    scalars = pl.BlockSpec((None, Tp, None), lambda b, h, c: (b, 0, h))
    state_spec = pl.BlockSpec((None, None, Dk, bv), lambda b, h, c: (b, h, 0, c))
    f32 = jnp.float32
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    dq, dk, dv, dg, dbeta, ds0 = pl.pallas_call(
        functools.partial(_bwd_kernel, chunk=chunk, scale=scale),
        grid=(B, H, nv),
        in_specs=[qk_spec, qk_spec, v_spec, scalars, scalars, pl.BlockSpec((None, Tp), lambda b, h, c: (b, 0)),
                  pl.BlockSpec((None, N), lambda b, h, c: (b, 0)),
                  pl.BlockSpec((None, None, N, Dk, bv), lambda b, h, c: (b, h, 0, 0, c)), v_spec, state_spec],
        out_specs=[pl.BlockSpec((None, Tp, None, None, Dk), lambda b, h, c: (b, 0, h, c, 0))] * 2
        + [v_spec] + [pl.BlockSpec((None, Tp, None, None), lambda b, h, c: (b, 0, h, c))] * 2 + [state_spec],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, nv, Dk), f32)] * 2 + [jax.ShapeDtypeStruct(v.shape, v.dtype)]
        + [jax.ShapeDtypeStruct((B, Tp, H, nv), f32)] * 2 + [jax.ShapeDtypeStruct((B, H, Dk, Dv), f32)],
        compiler_params=params,
        interpret=interpret,
        name="chunk_gated_delta_rule_bwd",
    )(q, k, v, g, beta, seg, before, states, do, ds)
    return dq.sum(axis=3), dk.sum(axis=3), dv, dg.sum(axis=3), dbeta.sum(axis=3), ds0


__all__ = ["gated_delta_pallas", "gated_delta_pallas_bwd", "unit_lower_inverse_rows"]
