"""The backward of kernel_v2's chunk layout as Pallas (Triton) kernels: backward_v2.py's four steps (its jnp is the
specification and the reference these are tested against), in flash-linear-attention's kernel split. Names and
masks: chunked.py's docstring; operands: kernel_v2.py's (api.v2_operands), with the forward's saved h (the state
entering each chunk) and v_new (= U - W h), and the cotangents do (in v's dtype) and ds (fp32) of o and the final
state. Per chunk n: Attn = scale (Q K^T * D) (causal, same segment), Q_read = scale exp(gamma) first Q,
K_write = exp(gamma_last - gamma) last K, carry = exp(gamma_last) first_last, T = (I + A)^-1.

    B0 `wy_t_kernel`    grid (B, H, N): T (K1's blocked inverse, kernel_v2.inverse_rows) and W = T (beta_k), stored
                        (the forward keeps neither; fla's forward saves T, recomputes W)
    B1 `dstate_kernel`  grid (B, H, Dv / block_dv), chunks in reverse (the mirror of K2): the fp32 state cotangent
                        dS [Dk, block_dv] in registers, from the final state's; per chunk dh_n = dS (the cotangent of
                        the state chunk n hands on, stored), dv_new = Attn^T do + K_write dS (fla's chunk_bwd_dv_local
                        fused with bwd_dhu), then dS = carry dS + Q_read^T do - W^T dv_new; dS at the end is the
                        initial state's cotangent
    B2 `dqkw_kernel`    grid (B, H, N, Dk / block_dk) (fla's chunk_bwd_dqkwg): over the key columns of the block,
                        dq (final), dk's part through o and S_{n+1}, dW = -dv_new h^T, and d gamma's part through
                        them (per key block; the attention-score terms once, in block 0)
    B3 `wy_bwd_kernel`  grid (B, H, N) (fla's prepare_wy_repr_bwd): through U = T (beta V), W = T (beta_k) and
                        T = (I + A)^-1 to dk, dv, dbeta and the rest of d gamma, then dg = the within-chunk reverse
                        cumulative sum of d gamma (a masked row sum: d gamma's partials from B2 plus a per-chunk term
                        added at the chunk's last token, which every suffix holds)

Dtypes as kernel_v2's: operands and stored intermediates (W, T, dh, dv_new, dW) in the store dtype (bf16 for bf16
operands, as fla), dots accumulating in fp32, the state cotangent, dk's part from B2 and d gamma in fp32; dq, dk,
dv in the operand dtype, dg, dbeta fp32. Measured in interpret mode on CPU (Dk = Dv = 128, 2 x 512, packed rows, an
initial state, the final state in the loss; ||x - ref|| / ||ref|| against the fp32 chunked form of the same bf16
values): dq 4.1e-3, dk 3.8e-3, dv 3.0e-3, dg 5.8e-3, dbeta 2.5e-3, d initial state 2.6e-3 (backward_v2.py's fp32
jnp from the same bf16 h and v_new: 3.9e-3, 3.3e-3, 1.7e-3, 4.4e-3, 5.5e-4, 1.7e-3; dq, dk, dv are themselves
rounded to bf16, ~2e-3). fp32 operands: = the jnp at 1e-5 (test_gated_delta.py).

Expected at Qwen3.5-0.8B, B 8, T 2048, H 16, Dk = Dv = 128, bf16, N = 32 chunks of 64 (4096 (row, head, chunk)
triples; [B, T, H, 128] bf16 = 67 MB, [B, H, N, 128, 128] bf16 = 268 MB), at ~2.5 TB/s and ~200 TFLOP/s dense
bf16 (the FLOPs are 2 x multiply-adds):
    B0  reads k (67 MB), writes W (67) and T (17): ~0.15 GB, 0.06 ms; ~1.3 GFLOP (K1's without U), but its
        blocked inverse is latency-bound like K1 (measured 0.55 ms for K1 with U): ~0.4-0.5 ms
    B1  reads q, k, W (3 x 67 MB, once per value block: x4 at block_dv 32), do (67), writes dh (268), dv_new (67):
        ~1.2 GB, 0.5 ms (much of it from L2: the value blocks of a head run together); FLOPs 4096 x 2 x
        (4 x 64*64*128 for Q K^T, once per value block, + 64*64*128 + 3 x 64*128*128) ~ 47 GFLOP (0.24 ms); the
        chain: 32 chunks of 5 dots per program (3 on the dependency chain), 512 programs on 132 SMs (2 a SM at
        255 registers), like K2 (measured 0.2-0.3 ms for the forward's): ~0.4-0.6 ms
    B2  reads q, k whole (for Q K^T) and do, v_new, dv_new once per key block (x2 at block_dk 64: 10 x 67 MB), the
        block's q, k columns (134 MB), h and dh once (2 x 268), writes dq (67), dk's part (fp32, 134), dW (67):
        ~1.6 GB, 0.65 ms; ~22 GFLOP (0.11 ms): ~0.6-0.7 ms
    B3  reads T, k, v, dv_new, dW (~0.3 GB), dk part (134 MB), writes dk, dv (134 MB), dg, dbeta: ~0.6 GB, 0.25 ms;
        ~13 GFLOP: ~0.25-0.3 ms
    together ~1.7-2.0 ms (backward_v2.py's jnp measured ~6.1 ms; fla's whole backward ~2.0 ms: RESULTS session 21).
B2 is the largest mover (h and dh are twice a token tensor each); block_dk = Dk would read q, k, do, v_new, dv_new
once (0.4 GB less) at the cost of registers (BwdKnobs: offline compile).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta.kernel_v2 import V2Knobs, chunk_rows, inverse_rows, sequential_specs


@dataclasses.dataclass(frozen=True)
class BwdKnobs:
    """The backward kernels' launch (static, hashable): block_dv value columns per program of B1, block_dk key
    columns per program of B2 (both cut to the head dims), warps per kernel. The defaults are the spill-free ones of
    an offline sm_90 compile (Triton 3.6, benchmarks/triton_offline_check.py dump-gdn, 0.8B shapes, bf16): B0 at 4
    warps 254 registers (8: 198), B1 at block_dv 32 and 4 warps 255 registers, 0 spill stores, 121 KB shared
    (block_dv 64 spills 228 B at 4 warps, 196 at 8), B2 at block_dk 64 and 8 warps 209 registers, 82 KB (4 warps
    spill 72 B; block_dk 32 at 4 warps 220, none), B3 at 8 warps 218 registers, 74 KB (4 warps spill 520 B). Not
    yet timed on a GPU."""
    block_dv: int = 32
    block_dk: int = 64
    wy_warps: int = 4
    state_warps: int = 4
    dqkw_warps: int = 8
    wy_bwd_warps: int = 8
    num_stages: int = 2

    def label(self) -> str:
        return (f"bv{self.block_dv}-bk{self.block_dk}-w{self.wy_warps}{self.state_warps}{self.dqkw_warps}"
                f"{self.wy_bwd_warps}-s{self.num_stages}")


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _iota(c: int):
    return jax.lax.broadcasted_iota(jnp.int32, (c, c), 0), jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)


def _decay(gamma, seg, mask):
    """D_ij = exp(gamma_i - gamma_j) where mask (and the pair in one segment), else 0: [C, C] fp32."""
    mask = mask & (seg[:, None] == seg[None, :])
    return jnp.where(mask, jnp.exp(jnp.where(mask, gamma[:, None] - gamma[None, :], 0.0)), 0.0)


def wy_t_kernel(k_ref, gamma_ref, beta_ref, seg_ref, first_ref, w_ref, t_ref):
    """B0, one chunk of one head: k_ref [C, Dk], gamma_ref, beta_ref, seg_ref, first_ref [C] -> w_ref [C, Dk],
    t_ref [C, C] (T, zero above the diagonal blocks)."""
    dt = w_ref.dtype
    for blocks, i, t_i, beta_k in inverse_rows(k_ref, gamma_ref, beta_ref, seg_ref, first_ref, dt):
        w = None
        for j, t_ij in enumerate(t_i):
            t_ij = t_ij.astype(dt)
            t_ref[blocks[i], blocks[j]] = t_ij
            w = _dot(t_ij, beta_k(j)) if w is None else w + _dot(t_ij, beta_k(j))
        for j in range(i + 1, len(blocks)):
            t_ref[blocks[i], blocks[j]] = jnp.zeros(t_i[0].shape, dt)
        w_ref[blocks[i], :] = w.astype(dt)


def dstate_kernel(q_ref, k_ref, w_ref, do_ref, gamma_ref, seg_ref, first_ref, last_ref, ds_ref, dh_ref, dv_new_ref,
                  ds0_ref, *, chunk: int, scale: float):
    """B1, one (row, head, value-column block), chunks in reverse: q_ref, k_ref, w_ref [Tp, Dk], do_ref,
    dv_new_ref [Tp, BV], gamma_ref, seg_ref, first_ref, last_ref [Tp], ds_ref, ds0_ref [Dk, BV] (the final and the
    initial state's cotangents, fp32), dh_ref [N, Dk, BV] (the cotangent of the state each chunk hands on)."""
    f32 = jnp.float32
    dt = w_ref.dtype
    n = dh_ref.shape[0]
    i, j = _iota(chunk)

    def body(step, ds):
        c = n - 1 - step
        tok = pl.ds(c * chunk, chunk)
        end = pl.ds(c * chunk + chunk - 1, 1)
        dh_ref[c] = ds.astype(dh_ref.dtype)
        gamma = gamma_ref[tok]
        gamma_last = jnp.sum(gamma_ref[end])
        q, k, do = q_ref[tok, :].astype(dt), k_ref[tok, :].astype(dt), do_ref[tok, :].astype(dt)
        attn = (_dot(q, k.T) * _decay(gamma, seg_ref[tok], i >= j) * scale).astype(dt)
        write = jnp.exp(gamma_last - gamma) * last_ref[tok]
        dv_new = (_dot(attn.T, do) + _dot(k, ds.astype(dt)) * write[:, None]).astype(dt)
        dv_new_ref[tok, :] = dv_new.astype(dv_new_ref.dtype)
        carry = jnp.exp(gamma_last) * jnp.sum(first_ref[end])
        do_read = (do.astype(f32) * (scale * jnp.exp(gamma) * first_ref[tok])[:, None]).astype(dt)  # Q_read^T do
        return carry * ds + _dot(q.T, do_read) - _dot(w_ref[tok, :].astype(dt).T, dv_new)

    ds0_ref[...] = jax.lax.fori_loop(0, n, body, ds_ref[...].astype(f32))


def dqkw_kernel(q_ref, k_ref, qb_ref, kb_ref, v_new_ref, do_ref, dv_new_ref, h_ref, dh_ref, gamma_ref, seg_ref,
                first_ref, last_ref, dq_ref, dk_ref, dw_ref, dgam_ref, *, scale: float):
    """B2, one chunk of one head, BK key columns: q_ref, k_ref [C, Dk], qb_ref, kb_ref [C, BK] (the block's
    columns), v_new_ref, do_ref, dv_new_ref [C, Dv], h_ref, dh_ref [BK, Dv] (the state entering the chunk and the
    cotangent of the one it hands on), gamma_ref, seg_ref, first_ref, last_ref [C] -> dq_ref (final), dk_ref (the
    part through o and S_{n+1}, fp32), dw_ref [C, BK], dgam_ref [C] (this block's part of d gamma, the per-chunk
    terms at the last token)."""
    f32 = jnp.float32
    dt = v_new_ref.dtype
    c = q_ref.shape[0]
    i, j = _iota(c)
    at_end = jax.lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1  # the chunk's last token
    gamma = gamma_ref[...]
    first, last = first_ref[...], last_ref[...]
    gamma_last = jnp.sum(jnp.where(at_end, gamma, 0.0))
    do, v_new, dv_new = do_ref[...].astype(dt), v_new_ref[...].astype(dt), dv_new_ref[...].astype(dt)
    h, dh = h_ref[...].astype(dt), dh_ref[...].astype(dt)
    d_attn = _dot(do, v_new.T)  # [C, C]
    d_qread = _dot(do, h.T)  # [C, BK]
    d_kwrite = _dot(v_new, dh.T)
    dw_ref[...] = (-_dot(dv_new, h.T)).astype(dw_ref.dtype)
    d_carry = jnp.sum(h.astype(f32) * dh.astype(f32))

    decay = _decay(gamma, seg_ref[...], i >= j)
    qk = _dot(q_ref[...].astype(dt), k_ref[...].astype(dt).T)
    d_qk = d_attn * decay * scale
    md = d_qk * qk  # d / d(gamma_i - gamma_j) through Attn
    read = scale * jnp.exp(gamma) * first
    write = jnp.exp(gamma_last - gamma) * last
    carry = jnp.exp(gamma_last) * jnp.sum(jnp.where(at_end, first, 0.0))
    qb, kb = qb_ref[...].astype(dt), kb_ref[...].astype(dt)
    d_qk = d_qk.astype(dt)
    dq_ref[...] = (_dot(d_qk, kb) + d_qread * read[:, None]).astype(dq_ref.dtype)
    dk_ref[...] = (_dot(d_qk.T, qb) + d_kwrite * write[:, None]).astype(dk_ref.dtype)
    d_write = jnp.sum(d_kwrite * kb.astype(f32), axis=1) * write
    d_gamma = jnp.sum(d_qread * qb.astype(f32), axis=1) * read - d_write
    d_gamma = d_gamma + jnp.where(at_end, jnp.sum(d_write) + d_carry * carry, 0.0)
    scores = jnp.sum(md, axis=1) - jnp.sum(md, axis=0)  # through the attention scores: once per chunk
    dgam_ref[...] = d_gamma + jnp.where(pl.program_id(3) == 0, scores, 0.0)


def wy_bwd_kernel(t_ref, k_ref, v_ref, dv_new_ref, dw_ref, dk_part_ref, dgam_ref, gamma_ref, beta_ref, seg_ref,
                  first_ref, dk_ref, dv_ref, dbeta_ref, dg_ref):
    """B3, one chunk of one head: t_ref [C, C], k_ref, dw_ref, dk_part_ref [C, Dk], v_ref, dv_new_ref [C, Dv],
    dgam_ref [Dk / BK, C] (B2's parts of d gamma), gamma_ref, beta_ref, seg_ref, first_ref [C] -> dk_ref [C, Dk],
    dv_ref [C, Dv], dbeta_ref, dg_ref [C]."""
    f32 = jnp.float32
    dt = t_ref.dtype
    c = t_ref.shape[0]
    i, j = _iota(c)
    gamma, beta = gamma_ref[...], beta_ref[...]
    eg_first = jnp.exp(gamma) * first_ref[...]
    read = beta * eg_first  # the share of k in W's right-hand side
    t_t = t_ref[...].T
    k, dv_new, dw = k_ref[...].astype(dt), dv_new_ref[...].astype(dt), dw_ref[...].astype(dt)
    k32, v32 = k.astype(f32), v_ref[...].astype(f32)

    d_beta_v = _dot(t_t, dv_new)  # [C, Dv]
    dv_ref[...] = (d_beta_v * beta[:, None]).astype(dv_ref.dtype)
    dbeta = jnp.sum(d_beta_v * v32, axis=1)
    d_beta_k = _dot(t_t, dw)  # [C, Dk]
    bk_k = jnp.sum(d_beta_k * k32, axis=1)
    dbeta = dbeta + bk_k * eg_first
    d_gamma = jnp.sum(dgam_ref[...], axis=0) + bk_k * read
    d_inv = (_dot(dv_new, (beta[:, None] * v32).astype(dt).T) + _dot(dw, (read[:, None] * k32).astype(dt).T))
    da = -_dot(_dot(t_t, d_inv.astype(dt)).astype(dt), t_t)
    decay = _decay(gamma, seg_ref[...], i > j)  # zero off A's pairs: da masked with it
    kk = _dot(k, k.T)
    da_decay = da * decay
    d_kk = da_decay * beta[:, None]
    dbeta = dbeta + jnp.sum(da_decay * kk, axis=1)
    md = d_kk * kk
    d_gamma = d_gamma + jnp.sum(md, axis=1) - jnp.sum(md, axis=0)
    dk = dk_part_ref[...] + d_beta_k * read[:, None] + _dot((d_kk + d_kk.T).astype(dt), k)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dbeta_ref[...] = dbeta
    dg_ref[...] = jnp.sum(jnp.where(j >= i, d_gamma[None, :], 0.0), axis=1)  # sum over the tokens from i on


def _params(bk: BwdKnobs, knobs: V2Knobs, warps: int):
    return None if knobs.interpret else plgpu.CompilerParams(num_warps=warps, num_stages=bk.num_stages)


def _per_head(chunk: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, chunk, None), lambda b, h, c, *_: (b, c, h))


def _per_row(chunk: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, chunk), lambda b, h, c, *_: (b, c))


def wy_t(k, gamma, beta, seg, first, *, knobs: V2Knobs, bwd: BwdKnobs, chunk: int, dtype):
    """B0 over (B, H, N) -> (W [B, Tp, H, Dk], T [B, Tp, H, C]) in dtype."""
    B, Tp, H, Dk = k.shape
    return pl.pallas_call(
        wy_t_kernel, grid=(B, H, Tp // chunk),
        in_specs=[chunk_rows(chunk, Dk), _per_head(chunk), _per_head(chunk), _per_row(chunk), _per_row(chunk)],
        out_specs=[chunk_rows(chunk, Dk), chunk_rows(chunk, chunk)],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dk), dtype), jax.ShapeDtypeStruct((B, Tp, H, chunk), dtype)],
        compiler_params=_params(bwd, knobs, bwd.wy_warps), interpret=knobs.interpret, name="gated_delta_v2_bwd_wy",
    )(k, gamma, beta, seg, first)


def dstates(q, k, w, do, gamma, seg, first, last, ds, *, knobs: V2Knobs, bwd: BwdKnobs, chunk: int):
    """B1 over (B, H, Dv / block_dv) -> (dh [B, H, N, Dk, Dv] and dv_new [B, Tp, H, Dv] in W's dtype, the initial
    state's cotangent [B, H, Dk, Dv] fp32)."""
    B, Tp, H, Dk = q.shape
    Dv = do.shape[-1]
    N, bv = Tp // chunk, min(bwd.block_dv, Dv)
    whole, columns, scalars, flags, state_spec, per_chunk = sequential_specs(Tp, N, Dk, bv)
    return pl.pallas_call(
        functools.partial(dstate_kernel, chunk=chunk, scale=knobs.scale), grid=(B, H, Dv // bv),
        in_specs=[whole, whole, whole, columns, scalars, flags, flags, flags, state_spec],
        out_specs=[per_chunk, columns, state_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, N, Dk, Dv), w.dtype), jax.ShapeDtypeStruct((B, Tp, H, Dv), w.dtype),
                   jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)],
        compiler_params=_params(bwd, knobs, bwd.state_warps), interpret=knobs.interpret,
        name="gated_delta_v2_bwd_state",
    )(q, k, w, do, gamma, seg, first, last, ds)


def dqkw(q, k, v_new, do, dv_new, h, dh, gamma, seg, first, last, *, knobs: V2Knobs, bwd: BwdKnobs, chunk: int):
    """B2 over (B, H, N, Dk / block_dk) -> (dq [B, Tp, H, Dk] in q's dtype, dk's part fp32, dW in v_new's dtype,
    d gamma's parts [Dk / block_dk, B, Tp, H] fp32)."""
    B, Tp, H, Dk = q.shape
    Dv = do.shape[-1]
    bk = min(bwd.block_dk, Dk)
    nk = Dk // bk
    key_cols = pl.BlockSpec((None, chunk, None, bk), lambda b, h, c, kb: (b, c, h, kb))
    state_rows = pl.BlockSpec((None, None, None, bk, Dv), lambda b, h, c, kb: (b, h, c, kb, 0))
    keys, values = chunk_rows(chunk, Dk), chunk_rows(chunk, Dv)
    return pl.pallas_call(
        functools.partial(dqkw_kernel, scale=knobs.scale), grid=(B, H, Tp // chunk, nk),
        in_specs=[keys, keys, key_cols, key_cols, values, values, values, state_rows, state_rows, _per_head(chunk),
                  _per_row(chunk), _per_row(chunk), _per_row(chunk)],
        out_specs=[key_cols, key_cols, key_cols,
                   pl.BlockSpec((None, None, chunk, None), lambda b, h, c, kb: (kb, b, c, h))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dk), q.dtype), jax.ShapeDtypeStruct((B, Tp, H, Dk), jnp.float32),
                   jax.ShapeDtypeStruct((B, Tp, H, Dk), v_new.dtype),
                   jax.ShapeDtypeStruct((nk, B, Tp, H), jnp.float32)],
        compiler_params=_params(bwd, knobs, bwd.dqkw_warps), interpret=knobs.interpret, name="gated_delta_v2_bwd_dqkw",
    )(q, k, q, k, v_new, do, dv_new, h, dh, gamma, seg, first, last)


def wy_bwd(t, k, v, dv_new, dw, dk_part, dgam, gamma, beta, seg, first, *, knobs: V2Knobs, bwd: BwdKnobs,
           chunk: int):
    """B3 over (B, H, N) -> (dk in k's dtype, dv in v's dtype, dbeta, dg [B, Tp, H] fp32)."""
    B, Tp, H, Dk = k.shape
    Dv = v.shape[-1]
    nk = dgam.shape[0]
    per_head = _per_head(chunk)
    keys, values = chunk_rows(chunk, Dk), chunk_rows(chunk, Dv)
    return pl.pallas_call(
        wy_bwd_kernel, grid=(B, H, Tp // chunk),
        in_specs=[chunk_rows(chunk, chunk), keys, values, values, keys, keys,
                  pl.BlockSpec((nk, None, chunk, None), lambda b, h, c: (0, b, c, h)), per_head, per_head,
                  _per_row(chunk), _per_row(chunk)],
        out_specs=[keys, values, per_head, per_head],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dk), k.dtype), jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype),
                   jax.ShapeDtypeStruct((B, Tp, H), jnp.float32), jax.ShapeDtypeStruct((B, Tp, H), jnp.float32)],
        compiler_params=_params(bwd, knobs, bwd.wy_bwd_warps), interpret=knobs.interpret,
        name="gated_delta_v2_bwd_wy_bwd",
    )(t, k, v, dv_new, dw, dk_part, dgam, gamma, beta, seg, first)


def chunk_backward(q, k, v, gamma, beta, seg, first, last, h, v_new, do, ds, *, knobs: V2Knobs,
                   bwd: BwdKnobs = BwdKnobs(), chunk: int):
    """backward_v2.chunk_backward's operands and results by the four kernels: prepared operands (kernel_v2's), the
    saved h [B, H, N, Dk, Dv] and v_new [B, Tp, H, Dv] (store dtype), do [B, Tp, H, Dv] (v's dtype), ds
    [B, H, Dk, Dv] fp32 -> (dq, dk, dv in their operands' dtypes, dg, dbeta fp32, d initial state fp32), on the
    prepared (padded) shapes."""
    dt = v_new.dtype
    kw = dict(knobs=knobs, bwd=bwd, chunk=chunk)
    w, t = wy_t(k, gamma, beta, seg, first, dtype=dt, **kw)
    dh, dv_new, ds0 = dstates(q, k, w, do, gamma, seg, first, last, ds, **kw)
    dq, dk_part, dw, dgam = dqkw(q, k, v_new, do, dv_new, h, dh, gamma, seg, first, last, **kw)
    dk, dv, dbeta, dg = wy_bwd(t, k, v, dv_new, dw, dk_part, dgam, gamma, beta, seg, first, **kw)
    return dq, dk, dv, dg, dbeta, ds0


__all__ = ["BwdKnobs", "chunk_backward", "dqkw", "dqkw_kernel", "dstate_kernel", "dstates", "wy_bwd",
           "wy_bwd_kernel", "wy_t", "wy_t_kernel"]
