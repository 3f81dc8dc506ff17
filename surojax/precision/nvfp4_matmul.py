"""The three GEMMs of an NVFP4 linear layer (arXiv 2509.25149, section 4), emulated: each operand is quantised to
NVFP4 exactly as on Blackwell, then multiplied by a bf16 GEMM (fp32 accumulation) on the exact block values and
rescaled by the two global factors in fp32 (nvfp4_quant's module docstring says why that is the Blackwell result
up to accumulation order).

    Fprop  y  = Q1x16(x) @ Q16x16(W)                                  x: RNE along K;   W: 16x16 tiles, RNE
    Dgrad  dx = Q1x16_SR(dy) @ Q16x16(W)^T                            dy: SR along N;   W^T: the same tiles
    Wgrad  dW = Q1x16(RHT(x^T)) @ Q1x16_SR(RHT(dy^T))^T               both along the tokens M (the contraction),
                                                                       after the 16x16 random Hadamard transform

    nvfp4_dot(x, w, key, signs)             x [..., K], w [K, N] trainable (full fine-tuning / pretraining)
    nvfp4_dot_frozen(x, w_q, key)           w_q an Nvfp4Tensor quantised once (a frozen LoRA base): no Wgrad

`key` (raw PRNG key data, uint32) draws the stochastic rounding of the two dy quantisations (split in two: Dgrad
and Wgrad quantise dy along different axes, each with its own draws); it has no gradient. `signs` (a static tuple
of 16 +-1, hadamard.random_signs) fixes the RHT for the run. The quantisers are straight-through: the gradient of
the rounding is taken as the identity (Transformer Engine does the same).

Tokens M not a multiple of 16 are padded with zero rows for the Wgrad quantisation (a zero row changes no amax and,
transformed or not, contributes nothing to the product); K and N must be multiples of 16 (nvfp4_transform checks).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from surojax.precision.hadamard import apply_rht
from surojax.precision.nvfp4_quant import BLOCK, Nvfp4Tensor, quantize_1x16, quantize_16x16

_NN = ((1,), (0,))  # [M, K] . [K, N] -> [M, N]
_NT = ((1,), (1,))  # [M, N] . [K, N] over N -> [M, K];  also [K, M] . [N, M] over M -> [K, N]


def nvfp4_gemm(a: Nvfp4Tensor, b: Nvfp4Tensor, dims, dtype) -> jax.Array:
    """dot_general(a, b) of two quantised 2-D operands: bf16 GEMM on the exact block values (fp32 accumulation),
    times g_a * g_b in fp32, then `dtype`."""
    y = jax.lax.dot_general(a.blocks(jnp.bfloat16), b.blocks(jnp.bfloat16), (dims, ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * (a.global_decode * b.global_decode)).astype(dtype)


def _flat(x):
    return x.reshape(-1, x.shape[-1])  # [..., K] -> [M, K]


def _keys(key):
    return jax.random.split(jax.random.wrap_key_data(key))  # (dgrad, wgrad)


def _tokens_last(t):
    """t [M, C] -> t^T [C, M'] with M' the next multiple of 16 (zero columns)."""
    pad = -t.shape[0] % BLOCK
    return jnp.pad(t.T, ((0, 0), (0, pad)))


def dgrad(g2: jax.Array, w_q: Nvfp4Tensor, key, dtype) -> jax.Array:
    """dx [M, K] = Q1x16_SR(dy [M, N]) @ Q16x16(W)^T."""
    return nvfp4_gemm(quantize_1x16(g2, "sr", key), w_q, _NT, dtype)


def wgrad(x2: jax.Array, g2: jax.Array, key, signs: tuple[int, ...], dtype) -> jax.Array:
    """dW [K, N] = RHT'd x^T [K, M] (RNE) . RHT'd dy^T [N, M] (SR), both quantised 1x16 along M."""
    x_h = quantize_1x16(apply_rht(_tokens_last(x2), signs), "rne")
    g_h = quantize_1x16(apply_rht(_tokens_last(g2), signs), "sr", key)
    return nvfp4_gemm(x_h, g_h, _NT, dtype)


# ---- trainable weight -----------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def nvfp4_dot(x: jax.Array, w: jax.Array, key: jax.Array, signs: tuple[int, ...]) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, the NVFP4 recipe's Fprop; its VJP runs Dgrad and Wgrad."""
    return _dot_fwd(x, w, key, signs)[0]


def _dot_fwd(x, w, key, signs):
    x2 = _flat(x)
    w_q = quantize_16x16(w)
    y = nvfp4_gemm(quantize_1x16(x2, "rne"), w_q, _NN, x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[-1]), (x2, w_q, key, jnp.zeros((), w.dtype))


def _dot_bwd(signs, res, g):
    x2, w_q, key, w_dtype = res  # w_dtype: a scalar carrying the weight's dtype (fp32 master or bf16)
    g2 = _flat(g)
    k_dgrad, k_wgrad = _keys(key)
    dx = dgrad(g2, w_q, k_dgrad, g.dtype)
    dw = wgrad(x2, g2, k_wgrad, signs, jnp.float32)
    return dx.reshape(*g.shape[:-1], x2.shape[-1]), dw.astype(w_dtype.dtype), None


nvfp4_dot.defvjp(_dot_fwd, _dot_bwd)


# ---- frozen weight quantised once -----------------------------------------------------------------------------

@jax.custom_vjp
def nvfp4_dot_frozen(x: jax.Array, w_q: Nvfp4Tensor, key: jax.Array) -> jax.Array:
    """x [..., K] @ w_q [K, N] (16x16-tiled, quantised once) -> [..., N]; VJP: Dgrad only (no weight gradient)."""
    return _frozen_fwd(x, w_q, key)[0]


def _frozen_fwd(x, w_q, key):
    y = nvfp4_gemm(quantize_1x16(_flat(x), "rne"), w_q, _NN, x.dtype)
    return y.reshape(*x.shape[:-1], w_q.values.shape[-1]), (w_q, key)


def _frozen_bwd(res, g):
    w_q, key = res
    dx = dgrad(_flat(g), w_q, _keys(key)[0], g.dtype)
    return dx.reshape(*g.shape[:-1], w_q.values.shape[0]), jax.tree.map(jnp.zeros_like, w_q), None


nvfp4_dot_frozen.defvjp(_frozen_fwd, _frozen_bwd)


__all__ = ["dgrad", "nvfp4_dot", "nvfp4_dot_frozen", "nvfp4_gemm", "wgrad"]
