"""The chunked gated delta rule's forward in flash-linear-attention's layout: three Pallas (Triton) kernels, so that
only the state's own recurrence is sequential and everything chunk-local runs once, chunk-parallel. The math and
the packed-row masks are chunked.py's (its module docstring; the names below are its names):

    K1 `wy_kernel`     grid (B, H, N chunks): A = beta_i D_ij (k_i . k_j) (j < i, same segment), T = (I + A)^-1
                       blocked like fla's solve_tril (16 x 16 diagonal blocks by forward substitution, merged with
                       fp32 matmuls), U = T (beta V) and W = T (beta exp(gamma) first K)
    K2 `state_kernel`  grid (B, H, Dv / block_v), chunks in order: the fp32 state S [Dk, block_v] in registers;
                       per chunk h_n = S (the state entering it), v_new = U - W S, then
                       S = carry S + K_write^T v_new  (K_write = k exp(gamma_last - gamma) last)
    K3 `output_kernel` grid (B, H, N, Dv / block_o): o = scale (exp(gamma) first (Q h_n) + (QK^T * D) v_new)

Operands (api.py prepares them; T padded to whole chunks, Dk and Dv powers of two >= 16):
    q, k [B, Tp, H, Dk], v [B, Tp, H, Dv] (the operand dtype), gamma (the chunk-local cumulative log decay),
    beta [B, Tp, H] fp32, seg [B, Tp] int32 (segment numbers), first, last [B, Tp] fp32 0 / 1 (the token reads the
    carried state / is in its chunk's last segment), state [B, H, Dk, Dv] fp32.

Stored intermediates (W, U, h, v_new) are in `store_dtype` (the operand dtype by default, as fla does); the
matmuls take their operands in that dtype and accumulate in fp32 (bf16 tensor-core dots on a GPU for bf16 operands);
the state carried from chunk to chunk is fp32. Only the inverse's merges run at fp32 precision ("highest": IEEE
fp32 in Triton), as in fla (an inverse in TF32 or bf16 would carry its error into every U and W).

Why bf16 storage for bf16 operands: half the bytes the sequential kernel streams per chunk (W, U, k: its loads are
the chain's latency) and bf16 tensor-core dots, at an error that stays under the bench's 1e-2. Measured in
interpret mode on CPU (Dk = Dv = 128, 2 x 512, 3 segments a row, an initial state; ||x - ref|| / ||ref|| against
the fp32 token reference of the same bf16 values): o 3.7e-3 and final state 3.6e-3 with bf16 storage; 1.7e-3 and
3.6e-7 with store_dtype "float32" (1.7e-3 is o's own rounding to bf16); gradients through backward_v2.py from the
bf16 h and v_new 1.7e-3 to 3.8e-3, the chunked jnp form's 2.3e-4 to 2.4e-3. fla stores the same in bf16.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta.kernel import unit_lower_inverse_rows

SUB = 16  # rows of the inverse's diagonal blocks (and the smallest Triton dot)


@dataclasses.dataclass(frozen=True)
class V2Knobs:
    """The three kernels' launch (static, hashable). block_v / block_o: value columns per program of K2 / K3."""
    scale: float
    interpret: bool
    # H100 sweep (benchmarks/RESULTS.md session 21, Dk = Dv = 128): bv64-bo128-w4-s2 the fastest forward + backward
    # at 0.8B 8 x 2048 (6.98 ms; bv32-bo64 7.10, bv16-bo64-w4-s3 7.44, 8 warps 7.6) and at 1 x 8192 (4.98; 5.32);
    # 8 warps slow K1 (0.97 against 0.55 ms). sm_90 offline (benchmarks/triton_offline_check.py dump-gdn): K2 at
    # bv32-w4-s2 106 registers, 82 KB shared; K3 at bo64-w4 119 registers, 32 KB; K1 250 registers, 13 KB; no
    # spills. 2 warps: no wgmma, spills in K2 / K3 (kept out)
    block_v: int = 64
    block_o: int = 128
    num_warps: int = 4
    num_stages: int = 2
    store_dtype: str | None = None  # None: the operand (v's) dtype
    backward: str = "jnp"  # "kernels": kernel_v2_bwd.py's four kernels; "jnp": backward_v2.py (api.BACKWARDS)

    def params(self):
        return None if self.interpret else plgpu.CompilerParams(num_warps=self.num_warps,
                                                                num_stages=self.num_stages)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_fp32(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def inverse_rows(k_ref, gamma_ref, beta_ref, seg_ref, first_ref, dt):
    """T = (I + A)^-1 of one chunk, one SUB-row block row at a time: yields (blocks, i, t_i, beta_k) with t_i the
    list of T's blocks (i, 0..i) in fp32 (T_ii = (I + A_ii)^-1, T_ij = -T_ii sum_{j <= m < i} A_im T_mj: fla's
    merge, in fp32) and beta_k(j) W's right-hand side's block j in dt. Operand blocks are read from the refs where
    used, so that only T's blocks stay live (registers: an sm_90 compile of a version that kept every block live
    used 255 a thread and spilled). K1 and the backward's wy_t_kernel share it."""
    f32 = jnp.float32
    nb = k_ref.shape[0] // SUB
    rows = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    blocks = [pl.ds(b * SUB, SUB) for b in range(nb)]

    def a_block(i, j):  # A's block (i, j), i >= j: beta_i exp(gamma_i - gamma_j) (k_i . k_j), masked
        mask = seg_ref[blocks[i]][:, None] == seg_ref[blocks[j]][None, :]
        if i == j:
            mask = mask & (rows > cols)
        decay = jnp.exp(jnp.where(mask, gamma_ref[blocks[i]][:, None] - gamma_ref[blocks[j]][None, :], 0.0))
        kk = _dot(k_ref[blocks[i], :], k_ref[blocks[j], :].T)
        return jnp.where(mask, beta_ref[blocks[i]][:, None] * decay * kk, 0.0)

    def beta_k(j):  # only the tokens that read the carried state
        read = beta_ref[blocks[j]] * jnp.exp(gamma_ref[blocks[j]]) * first_ref[blocks[j]]
        return (read[:, None] * k_ref[blocks[j], :].astype(f32)).astype(dt)

    t = {}
    for i in range(nb):
        a = [a_block(i, j) for j in range(i + 1)]
        t[i, i] = unit_lower_inverse_rows(a[i])  # forward substitution, 16 steps
        for j in range(i - 1, -1, -1):
            acc = _dot_fp32(a[j], t[j, j])
            for m in range(j + 1, i):
                acc = acc + _dot_fp32(a[m], t[m, j])
            t[i, j] = -_dot_fp32(t[i, i], acc)
        yield blocks, i, [t[i, j] for j in range(i + 1)], beta_k


def wy_kernel(k_ref, v_ref, gamma_ref, beta_ref, seg_ref, first_ref, w_ref, u_ref):
    """K1, one chunk of one head: k_ref [C, Dk], v_ref [C, Dv], gamma_ref, beta_ref, seg_ref, first_ref [C] ->
    w_ref [C, Dk], u_ref [C, Dv]: T's block rows (inverse_rows), then their rows of U and W, stored."""
    f32 = jnp.float32
    dt = w_ref.dtype
    for blocks, i, t_i, beta_k in inverse_rows(k_ref, gamma_ref, beta_ref, seg_ref, first_ref, dt):
        u = w = None
        for j, t_ij in enumerate(t_i):
            t_ij = t_ij.astype(dt)
            beta_v = (beta_ref[blocks[j]][:, None] * v_ref[blocks[j], :].astype(f32)).astype(dt)
            u = _dot(t_ij, beta_v) if u is None else u + _dot(t_ij, beta_v)
            w = _dot(t_ij, beta_k(j)) if w is None else w + _dot(t_ij, beta_k(j))
        u_ref[blocks[i], :] = u.astype(u_ref.dtype)
        w_ref[blocks[i], :] = w.astype(w_ref.dtype)


def state_kernel(w_ref, u_ref, k_ref, gamma_ref, first_ref, last_ref, s0_ref, h_ref, v_new_ref, s_ref, *,
                 chunk: int):
    """K2, one (row, head, value-column block), chunks in order: w_ref, k_ref [Tp, Dk], u_ref, v_new_ref [Tp, BV],
    gamma_ref, first_ref, last_ref [Tp], s0_ref, s_ref [Dk, BV] (the initial and the final state, fp32),
    h_ref [N, Dk, BV] (the state entering each chunk)."""
    f32 = jnp.float32
    dt = w_ref.dtype

    def body(c, s):
        tok = pl.ds(c * chunk, chunk)
        end = pl.ds(c * chunk + chunk - 1, 1)
        h_ref[c] = s.astype(h_ref.dtype)
        v_new = (u_ref[tok, :].astype(f32) - _dot(w_ref[tok, :], s.astype(dt))).astype(dt)
        v_new_ref[tok, :] = v_new.astype(v_new_ref.dtype)
        gamma_last = jnp.sum(gamma_ref[end])
        write = jnp.exp(gamma_last - gamma_ref[tok]) * last_ref[tok]  # [C]: the share each token writes
        carry = jnp.exp(gamma_last) * jnp.sum(first_ref[end])  # the old state's share of the next one
        k = k_ref[tok, :].astype(dt)
        return carry * s + _dot(k.T, (v_new.astype(f32) * write[:, None]).astype(dt))

    s_ref[...] = jax.lax.fori_loop(0, h_ref.shape[0], body, s0_ref[...].astype(f32))


def output_kernel(q_ref, k_ref, gamma_ref, seg_ref, first_ref, h_ref, v_new_ref, o_ref, *, scale: float):
    """K3, one chunk of one head, BO value columns: q_ref, k_ref [C, Dk], gamma_ref, seg_ref, first_ref [C],
    h_ref [Dk, BO] (the state entering the chunk), v_new_ref [C, BO] -> o_ref [C, BO]."""
    dt = v_new_ref.dtype
    c = q_ref.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    gamma, seg = gamma_ref[...], seg_ref[...]
    q = q_ref[...].astype(dt)
    causal = (i >= j) & (seg[:, None] == seg[None, :])
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    attn = (_dot(q, k_ref[...].astype(dt).T) * decay).astype(dt)
    read = jnp.exp(gamma) * first_ref[...]
    o = _dot(q, h_ref[...].astype(dt)) * read[:, None] + _dot(attn, v_new_ref[...])
    o_ref[...] = (o * scale).astype(o_ref.dtype)


def operand_shapes(B: int, Tp: int, H: int, Dk: int, Dv: int, dtype) -> tuple:
    """jax.ShapeDtypeStructs of chunk_forward's operands (q, k, v in dtype), for lowering without arrays."""
    f32 = jnp.float32
    per_head, per_row = jax.ShapeDtypeStruct((B, Tp, H), f32), jax.ShapeDtypeStruct((B, Tp), f32)
    qk = jax.ShapeDtypeStruct((B, Tp, H, Dk), dtype)
    return (qk, qk, jax.ShapeDtypeStruct((B, Tp, H, Dv), dtype), per_head, per_head,
            jax.ShapeDtypeStruct((B, Tp), jnp.int32), per_row, per_row, jax.ShapeDtypeStruct((B, H, Dk, Dv), f32))


def chunk_rows(chunk: int, width: int) -> pl.BlockSpec:  # one chunk of one head: grid (b, h, c, ...)
    return pl.BlockSpec((None, chunk, None, width), lambda b, h, c, *_: (b, c, h, 0))


def wy(k, v, gamma, beta, seg, first, *, knobs: V2Knobs, chunk: int, dtype):
    """K1 over (B, H, N) -> (W [B, Tp, H, Dk], U [B, Tp, H, Dv]) in dtype."""
    B, Tp, H, Dk = k.shape
    Dv = v.shape[-1]
    per_head = pl.BlockSpec((None, chunk, None), lambda b, h, c: (b, c, h))
    per_row = pl.BlockSpec((None, chunk), lambda b, h, c: (b, c))
    return pl.pallas_call(
        wy_kernel, grid=(B, H, Tp // chunk),
        in_specs=[chunk_rows(chunk, Dk), chunk_rows(chunk, Dv), per_head, per_head, per_row, per_row],
        out_specs=[chunk_rows(chunk, Dk), chunk_rows(chunk, Dv)],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dk), dtype), jax.ShapeDtypeStruct((B, Tp, H, Dv), dtype)],
        compiler_params=knobs.params(), interpret=knobs.interpret, name="gated_delta_v2_wy",
    )(k, v, gamma, beta, seg, first)


def sequential_specs(Tp: int, N: int, Dk: int, bv: int):
    """The BlockSpecs of a sequential kernel over (B, H, Dv / bv) (K2 and the backward's mirror of it): whole
    [Tp, Dk] rows, value columns [Tp, bv], per-head scalars [Tp], per-row flags [Tp], a state block [Dk, bv], the
    per-chunk states [N, Dk, bv]."""
    return (pl.BlockSpec((None, Tp, None, Dk), lambda b, h, j: (b, 0, h, 0)),
            pl.BlockSpec((None, Tp, None, bv), lambda b, h, j: (b, 0, h, j)),
            pl.BlockSpec((None, Tp, None), lambda b, h, j: (b, 0, h)),
            pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, None, Dk, bv), lambda b, h, j: (b, h, 0, j)),
            pl.BlockSpec((None, None, N, Dk, bv), lambda b, h, j: (b, h, 0, 0, j)))


def states(w, u, k, gamma, first, last, state, *, knobs: V2Knobs, chunk: int):
    """K2 over (B, H, Dv / block_v) -> (h [B, H, N, Dk, Dv] in W's dtype, v_new [B, Tp, H, Dv] in W's dtype,
    final state [B, H, Dk, Dv] fp32)."""
    B, Tp, H, Dk = k.shape
    Dv = u.shape[-1]
    N, bv = Tp // chunk, min(knobs.block_v, Dv)
    whole, columns, scalars, flags, state_spec, per_chunk = sequential_specs(Tp, N, Dk, bv)
    return pl.pallas_call(
        functools.partial(state_kernel, chunk=chunk), grid=(B, H, Dv // bv),
        in_specs=[whole, columns, whole, scalars, flags, flags, state_spec],
        out_specs=[per_chunk, columns, state_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, N, Dk, Dv), w.dtype), jax.ShapeDtypeStruct((B, Tp, H, Dv), w.dtype),
                   jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)],
        compiler_params=knobs.params(), interpret=knobs.interpret, name="gated_delta_v2_state",
    )(w, u, k, gamma, first, last, state)


def output(q, k, gamma, seg, first, h, v_new, *, knobs: V2Knobs, chunk: int, dtype):
    """K3 over (B, H, N, Dv / block_o) -> o [B, Tp, H, Dv] in dtype."""
    B, Tp, H, Dk = q.shape
    Dv = v_new.shape[-1]
    bo = min(knobs.block_o, Dv)
    per_head = pl.BlockSpec((None, chunk, None), lambda b, h, c, j: (b, c, h))
    per_row = pl.BlockSpec((None, chunk), lambda b, h, c, j: (b, c))
    out_cols = pl.BlockSpec((None, chunk, None, bo), lambda b, h, c, j: (b, c, h, j))
    return pl.pallas_call(
        functools.partial(output_kernel, scale=knobs.scale), grid=(B, H, Tp // chunk, Dv // bo),
        in_specs=[chunk_rows(chunk, Dk), chunk_rows(chunk, Dk), per_head, per_row, per_row,
                  pl.BlockSpec((None, None, None, Dk, bo), lambda b, h, c, j: (b, h, c, 0, j)), out_cols],
        out_specs=out_cols,
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, Dv), dtype),
        compiler_params=knobs.params(), interpret=knobs.interpret, name="gated_delta_v2_output",
    )(q, k, gamma, seg, first, h, v_new)


def chunk_forward(q, k, v, gamma, beta, seg, first, last, state, *, knobs: V2Knobs, chunk: int,
                  save_states: bool = False):
    """The three kernels on prepared operands (module docstring) -> (o [B, Tp, H, Dv] in v's dtype, final state
    [B, H, Dk, Dv] fp32), and with save_states also (h [B, H, N, Dk, Dv], v_new [B, Tp, H, Dv]) in store_dtype:
    what a backward in this layout reads."""
    dt = jnp.dtype(knobs.store_dtype) if knobs.store_dtype else v.dtype
    w, u = wy(k, v, gamma, beta, seg, first, knobs=knobs, chunk=chunk, dtype=dt)
    h, v_new, final = states(w, u, k, gamma, first, last, state, knobs=knobs, chunk=chunk)
    o = output(q, k, gamma, seg, first, h, v_new, knobs=knobs, chunk=chunk, dtype=v.dtype)
    return (o, final, h, v_new) if save_states else (o, final)


__all__ = ["SUB", "V2Knobs", "chunk_forward", "chunk_rows", "inverse_rows", "operand_shapes", "output",
           "output_kernel", "sequential_specs", "state_kernel", "states", "wy", "wy_kernel"]
