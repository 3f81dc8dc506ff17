"""The gated delta rule in chunks of CHUNK tokens (flash-linear-attention's chunk algorithm), pure jnp: the work
inside a chunk is a few matmuls (parallel over chunks), only a [Dk, Dv] fp32 state is carried from chunk to chunk
(lax.scan). Same operands and results as reference.py; its gradient is JAX autodiff of this form.

Per (row, head) and chunk, tokens i, j in 0..C-1, S0 the state entering the chunk, gamma_i = g_0 + ... + g_i (the
chunk's cumulative log decay), D_ij = exp(gamma_i - gamma_j) for j <= i. The recurrence of reference.py unrolled
over a chunk writes, for each token, the correction u_i (the part of beta_i v_i the state does not predict):

    u_i = beta_i (v_i - exp(gamma_i) S0^T k_i - sum_{j<i} D_ij (k_i . k_j) u_j)

a unit lower-triangular system (I + A) u = beta v - beta exp(gamma) K S0 with A_ij = beta_i D_ij (k_i . k_j),
j < i. Solving it once per chunk (the UT / WY representation) gives U = (I + A)^-1 (beta V) and
W = (I + A)^-1 (beta exp(gamma) K), so that u = U - W S0 for whatever S0 the chunk receives. Then

    o_i   = scale (exp(gamma_i) q_i^T S0 + sum_{j<=i} D_ij (q_i . k_j) u_j)
    S_end = exp(gamma_C-1) S0 + sum_j exp(gamma_C-1 - gamma_j) k_j u_j^T

Packed rows (the state resets where segment_ids changes, as in reference.py): with n_t the number of segment
starts up to t in the row, the pairs (i, j) with n_i != n_j are masked (in A and in the output's sum), the
carried state is read only by tokens still in the segment the chunk started in (n_i = n of the token before the
chunk), the old state is carried past the chunk only if no segment starts in it, and only the tokens of the
chunk's last segment write the state it hands on. A row whose length is not a multiple of CHUNK is padded with
tokens that neither decay (g = 0) nor write (beta = 0, k = 0) and continue the last segment.

`chunk_operands` prepares the chunk-local quantities every form shares (this scan and the Pallas kernel's
segment masks): the kernel receives the same padded, chunked operands.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.reference import segment_starts

CHUNK = 64


def segment_numbers(segment_ids, shape: tuple[int, int]) -> jax.Array:
    """[B, T] int32: how many segments started up to and including t (0 for the first segment of the row)."""
    return jnp.cumsum(segment_starts(segment_ids, shape).astype(jnp.int32), axis=1)


def pad_to_chunks(q, k, v, g, beta, seg, chunk: int = CHUNK):
    """Pad T to a multiple of `chunk` (q, k, v keep their dtype, g and beta become fp32; padding: q = k = v = 0,
    g = 0, beta = 0, the last segment continued). Returns (q, k, v, g, beta, seg, before) with seg [B, Tp] the
    segment numbers and before [B, N] the segment number of the token preceding each chunk (0 before the first)."""
    B, T = g.shape[:2]
    pad = -T % chunk

    def zeros_after(x):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    q, k, v = (zeros_after(x) for x in (q, k, v))
    g, beta = (zeros_after(x.astype(jnp.float32)) for x in (g, beta))
    seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
    before = jnp.concatenate([jnp.zeros((B, 1), seg.dtype), seg[:, chunk - 1:-1:chunk]], axis=1)
    return q, k, v, g, beta, seg, before


def _chunked(x, chunk: int):
    """[B, Tp, H, ...] -> [B, H, N, C, ...]."""
    B, Tp, H = x.shape[:3]
    return jnp.moveaxis(x.reshape(B, Tp // chunk, chunk, H, *x.shape[3:]), 3, 1)


def unit_lower_inverse(a, block: int = 16):
    """(I + a)^-1 for a strictly lower-triangular [..., C, C] (C = block * 2^k): the diagonal blocks by a batched
    triangular solve against the identity, then merged by halves with matmuls,
        [[I + A11, 0], [A21, I + A22]]^-1 = [[T11, 0], [-T22 A21 T11, T22]],
    so most of the work is tensor-core matmuls (flash-linear-attention's solve_tril builds the inverse the same way).
    The merges run at fp32 precision ("highest"): an inverse in TF32 would carry its 1e-3 error into every U and W."""
    C = a.shape[-1]
    if C <= block:
        eye = jnp.broadcast_to(jnp.eye(C, dtype=a.dtype), a.shape)
        return jax.lax.linalg.triangular_solve(a + eye, eye, left_side=True, lower=True, unit_diagonal=True)
    h = C // 2
    t11, t22 = unit_lower_inverse(a[..., :h, :h], block), unit_lower_inverse(a[..., h:, h:], block)
    with jax.default_matmul_precision("highest"):
        t21 = -(t22 @ a[..., h:, :h] @ t11)
    zeros = jnp.zeros_like(t11)
    return jnp.concatenate([jnp.concatenate([t11, zeros], -1), jnp.concatenate([t21, t22], -1)], -2)


def chunk_gated_delta_rule_chunked(q, k, v, g, beta, *, scale: float, segment_ids=None, initial_state=None,
                                   output_final_state: bool = False, chunk: int = CHUNK):
    """reference.py's operands and results, computed chunk by chunk (module docstring).

    Everything but the state's own recurrence is computed for all chunks at once: the sequential part is
    S_{n+1} = M_n S_n + R_n with M_n = carry_n I - K_write^T W and R_n = K_write^T U (one [Dk, Dk] x [Dk, Dv] matmul
    per chunk), and the outputs o = (Q_read - attn W) S_n + attn U follow in one batched matmul. (The first version
    scanned u, o and the state per chunk, four matmuls a step and their transposes in the backward: on an H100 at
    Qwen3.5-0.8B shapes, 8 x 2048, forward + backward 13.8 ms against 10.6 ms here; benchmarks/RESULTS.md.)"""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    f32, out_dtype = jnp.float32, v.dtype
    seg = segment_numbers(segment_ids, (B, T))
    q, k, v, g, beta, seg, before = pad_to_chunks(q, k, v, g, beta, seg, chunk)
    q, k, v, g, beta = (_chunked(x.astype(f32), chunk) for x in (q, k, v, g, beta))  # [B, H, N, C, ...]
    seg = seg.reshape(B, 1, -1, chunk)  # [B, 1, N, C]: the same for every head
    first = seg == before.reshape(B, 1, -1, 1)  # tokens that read the carried state
    last = seg == seg[..., -1:]  # tokens of the chunk's last segment (they write the state handed on)
    same = seg[..., :, None] == seg[..., None, :]  # [B, 1, N, C, C]

    gamma = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    i = jnp.arange(chunk)
    causal = (i[:, None] >= i[None, :]) & same  # j <= i, same segment
    strict = (i[:, None] > i[None, :]) & same
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)  # D_ij, 0 off the causal pairs

    kk = jnp.einsum("...ik,...jk->...ij", k, k)
    a = jnp.where(strict, beta[..., :, None] * decay * kk, 0.0)
    rhs_w = (beta * jnp.exp(gamma) * first)[..., None] * k
    inverse = unit_lower_inverse(a)  # T = (I + A)^-1
    u0, w = inverse @ (beta[..., None] * v), inverse @ rhs_w  # U [.., C, Dv], W [.., C, Dk]

    attn = jnp.einsum("...ik,...jk->...ij", q, k) * decay * scale  # [.., C, C]
    q_read = q * (jnp.exp(gamma) * first * scale)[..., None]  # reads of the carried state
    k_write = k * (jnp.exp(gamma[..., -1:] - gamma) * last)[..., None]  # writes of the state handed on
    carry = jnp.exp(gamma[..., -1]) * first[..., -1]  # [B, H, N]: the old state's share of the next one

    state = jnp.zeros((B, H, Dk, Dv), f32) if initial_state is None else initial_state.astype(f32)

    kw = jnp.einsum("...ck,...cj->...kj", k_write, w)  # [B, H, N, Dk, Dk]
    m = carry[..., None, None] * jnp.eye(Dk, dtype=f32) - kw
    r = jnp.einsum("...ck,...cv->...kv", k_write, u0)  # [B, H, N, Dk, Dv]

    def advance(state, xs):
        m, r = xs
        return jnp.einsum("bhkj,bhjv->bhkv", m, state) + r, state

    state, entering = jax.lax.scan(advance, state, (jnp.moveaxis(m, 2, 0), jnp.moveaxis(r, 2, 0)))
    entering = jnp.moveaxis(entering, 0, 2)  # [B, H, N, Dk, Dv]: the state each chunk starts from
    o = jnp.einsum("...ck,...kv->...cv", q_read - attn @ w, entering) + attn @ u0  # [B, H, N, C, Dv]
    o = o.reshape(B, H, -1, Dv)[:, :, :T]
    return jnp.moveaxis(o, 1, 2).astype(out_dtype), (state if output_final_state else None)


__all__ = ["CHUNK", "chunk_gated_delta_rule_chunked", "pad_to_chunks", "segment_numbers", "unit_lower_inverse"]
