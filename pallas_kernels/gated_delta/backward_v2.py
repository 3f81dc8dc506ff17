"""The backward of kernel_v2's chunk layout, in jnp: the VJP of o and the final state, from the forward kernels'
saved h (the state entering each chunk) and v_new (= U - W h), decomposed the way flash-linear-attention's
chunk backward is, so that each step is the specification of a Pallas kernel (kernel_v2_bwd.py; this jnp is their
reference in the tests):

    1. chunk-parallel  dv_local = Attn^T do                                         (fla: chunk_bwd_dv_local)
    2. sequential      dS_n = M_n^T dS_{n+1} + Q_read^T do - W^T dv_local, in reverse over the chunks, from the
                       final state's cotangent (M_n = carry I - K_write^T W, the forward's; fla: bwd_dhu)
    3. chunk-parallel  dv_new = dv_local + K_write dS_{n+1}; the gradients through o = Q_read h + Attn v_new and
                       S_{n+1} = carry h + K_write^T v_new (fla: chunk_bwd_dqkwg)
    4. chunk-parallel  through U = T (beta V), W = T (beta exp(gamma) first K), T = (I + A)^-1 and A
                       (fla: prepare_wy_repr_bwd), then dg = the reverse cumulative sum of d gamma in each chunk

Names and masks: chunked.py's docstring; operands: kernel_v2.py's (prepared by api.v2_operands). fp32 throughout,
matmuls at the default precision. T is recomputed from the operands (chunked.py's unit_lower_inverse), not saved.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunked import unit_lower_inverse


def _chunks(x, chunk: int):
    """[B, Tp, H, ...] -> [B, H, N, C, ...] fp32."""
    B, Tp, H = x.shape[:3]
    return jnp.moveaxis(x.reshape(B, Tp // chunk, chunk, H, *x.shape[3:]), 3, 1).astype(jnp.float32)


def _tokens(x):
    """[B, H, N, C, ...] -> [B, N * C, H, ...]."""
    B, H, N, C = x.shape[:4]
    return jnp.moveaxis(x, 1, 3).reshape(B, N * C, H, *x.shape[4:])


def chunk_backward(q, k, v, gamma, beta, seg, first, last, h, v_new, do, ds, *, scale: float, chunk: int,
                   intermediates: bool = False):
    """Prepared operands (kernel_v2.chunk_forward's), its saved h [B, H, N, Dk, Dv] and v_new [B, Tp, H, Dv], the
    cotangents do [B, Tp, H, Dv] and ds [B, H, Dk, Dv] of o and the final state -> (dq, dk, dv, d gamma's g: dg,
    dbeta, d initial state), fp32, on the prepared (padded) shapes. intermediates: also (dS_{n+1} of each chunk
    [B, H, N, Dk, Dv], dv_new [B, Tp, H, Dv]), what kernel_v2_bwd's sequential kernel hands on (its tests)."""
    B, Tp, H, Dk = q.shape
    f32 = jnp.float32
    ein = jnp.einsum
    q, k, v, do, v_new = (_chunks(x, chunk) for x in (q, k, v, do, v_new))  # [B, H, N, C, D]
    gamma, beta = _chunks(gamma, chunk), _chunks(beta, chunk)  # [B, H, N, C]
    seg, first, last = (x.reshape(B, 1, -1, chunk) for x in (seg, first, last))
    h = h.astype(f32)

    i = jnp.arange(chunk)
    same = seg[..., :, None] == seg[..., None, :]
    causal = (i[:, None] >= i[None, :]) & same
    strict = (i[:, None] > i[None, :]) & same
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, gamma[..., :, None] - gamma[..., None, :], 0.0)), 0.0)
    kk = ein("...ik,...jk->...ij", k, k)
    qk = ein("...ik,...jk->...ij", q, k)
    inv = unit_lower_inverse(jnp.where(strict, beta[..., :, None] * decay * kk, 0.0))  # T
    eg = jnp.exp(gamma)
    read = beta * eg * first  # the share of k in W's right-hand side
    beta_v, beta_k = beta[..., None] * v, read[..., None] * k
    w = inv @ beta_k
    attn = qk * decay * scale
    q_read = q * (scale * eg * first)[..., None]
    ew = jnp.exp(gamma[..., -1:] - gamma) * last  # K_write = k * ew
    k_write = k * ew[..., None]
    carry = jnp.exp(gamma[..., -1]) * first[..., -1]  # [B, H, N]

    # 1, 2: the state's cotangent, chunks in reverse (dS_{n+1}: the cotangent of the state chunk n hands on)
    dv_local = ein("...ji,...jv->...iv", attn, do)
    m_t = carry[..., None, None] * jnp.eye(Dk, dtype=f32) - ein("...ck,...cj->...jk", k_write, w)  # M_n^T
    r = ein("...ck,...cv->...kv", q_read, do) - ein("...ck,...cv->...kv", w, dv_local)

    def back(ds_next, xs):
        m_t, r = xs
        return ein("bhkj,bhjv->bhkv", m_t, ds_next) + r, ds_next

    ds0, ds_next = jax.lax.scan(back, ds.astype(f32), (jnp.moveaxis(m_t, 2, 0), jnp.moveaxis(r, 2, 0)),
                                reverse=True)
    ds_next = jnp.moveaxis(ds_next, 0, 2)  # [B, H, N, Dk, Dv]

    # 3: through o = Q_read h + Attn v_new and S_{n+1} = carry h + K_write^T v_new
    dv_new = dv_local + k_write @ ds_next
    d_attn = ein("...iv,...jv->...ij", do, v_new)
    d_qread = ein("...cv,...kv->...ck", do, h)
    d_kwrite = ein("...cv,...kv->...ck", v_new, ds_next)
    d_carry = jnp.sum(h * ds_next, axis=(-2, -1))
    # 4: through v_new = U - W h, U = T beta V, W = T beta_k, T = (I + A)^-1, A = beta_i D_ij kk_ij
    dw = -ein("...cv,...kv->...ck", dv_new, h)
    d_inv = ein("...iv,...jv->...ij", dv_new, beta_v) + ein("...ik,...jk->...ij", dw, beta_k)
    inv_t = jnp.swapaxes(inv, -1, -2)
    d_beta_v, d_beta_k = inv_t @ dv_new, inv_t @ dw
    da = jnp.where(strict, -(inv_t @ d_inv @ inv_t), 0.0)
    d_qk = d_attn * decay * scale
    d_kk = da * beta[..., :, None] * decay
    d_decay = d_attn * qk * scale + da * beta[..., :, None] * kk
    md = d_decay * decay  # d / d(gamma_i - gamma_j)
    bk_k = jnp.sum(d_beta_k * k, axis=-1)
    d_ew = jnp.sum(d_kwrite * k, axis=-1) * ew
    dq = d_qk @ k + d_qread * (scale * eg * first)[..., None]
    dk = (ein("...ij,...ik->...jk", d_qk, q) + (d_kk + jnp.swapaxes(d_kk, -1, -2)) @ k
          + d_beta_k * read[..., None] + d_kwrite * ew[..., None])
    dv = d_beta_v * beta[..., None]
    dbeta = jnp.sum(da * decay * kk, axis=-1) + jnp.sum(d_beta_v * v, axis=-1) + bk_k * eg * first
    d_gamma = (jnp.sum(md, axis=-1) - jnp.sum(md, axis=-2) + jnp.sum(d_qread * q, axis=-1) * scale * eg * first
               + bk_k * read - d_ew)
    d_gamma_last = jnp.sum(d_ew, axis=-1) + d_carry * carry
    dg = jnp.flip(jnp.cumsum(jnp.flip(d_gamma, -1), axis=-1), -1) + d_gamma_last[..., None]
    grads = (_tokens(dq), _tokens(dk), _tokens(dv), _tokens(dg), _tokens(dbeta), ds0)
    return grads + ((ds_next, _tokens(dv_new)) if intermediates else ())


__all__ = ["chunk_backward"]
