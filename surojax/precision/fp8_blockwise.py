"""Block-wise FP8 scaling (`fp8_scaling: blockwise`, DeepSeek-V3's layout), emulated on Hopper.

Every tile of 128 values gets its own scale, taken from that tile's amax in the same step (current scaling):

    forward      x [M, K]  1 x 128 tiles along K    W [K, N]  128 x 128 blocks     (E4M3)
    dgrad        dy [M, N] 1 x 128 tiles along N    W         the forward's blocks (E5M2 / E4M3)
    wgrad        x [M, K]  128 x 1 tiles along M    dy        128 x 1 tiles along M (E4M3 / E5M2)

The scales are powers of two, d = 2^ceil(log2(amax / fp8_max)) (the UE8M0 scales of DeepSeek-V3.1 and MXFP8,
where DeepSeek-V3 kept fp32 scales): q * d is then exactly representable in bf16, so the emulation below computes
the product of exactly these FP8 operands. A power-of-two scale costs no relative precision (FP8 is floating
point), only up to one binade at the bottom of the range.

Emulation: the GEMM is a bf16 GEMM (fp32 accumulation) of the dequantised operands. cuBLASLt's per-tensor scaled
FP8 GEMM cannot take a scale that changes along the contraction dimension, and a batched FP8 dot per 128-wide K
slice would need a [K/128, M, N] fp32 intermediate. The dequantisation reads the FP8 bytes through a 256-entry
table (bitcast to uint8, gather) rather than `convert(f8 -> bf16)`: XLA GPU's float normalisation rewrites a
`convert(f32 -> f8) -> convert(f8 -> bf16)` chain as one convert and would drop the FP8 rounding (docs/precision.md).
This path is therefore *slower* than bf16 (extra quantise / dequantise passes) and exists for numerics; a fast one
needs a GEMM kernel that applies the per-tile scales while it accumulates (DeepGEMM's Hopper WGMMA kernel promotes
the tensor-core partial sums to fp32 registers every 128 K and multiplies in the two scales there).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from surojax.precision.fp8_matmul import _flat
from surojax.precision.fp8_scaling import E4M3, E5M2, scale_from_amax, spec

TILE = 128
ROW_TILE = (1, TILE)  # 1 x 128 along the last axis
COL_TILE = (TILE, 1)  # 128 x 1 along the first axis
BLOCK = (TILE, TILE)

_LUT = {jnp.dtype(t): np.arange(256, dtype=np.uint8).view(n).astype(np.float32)
        for t, n in ((E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2))}


def pow2_factor(block_amax: jax.Array, fp8_max: float) -> jax.Array:
    """d = 2^ceil(log2(amax / fp8_max)) in fp32 (amax / d <= fp8_max); 1 where amax is 0 or not finite. The
    reciprocal of the per-tensor rule's power-of-two scale (fp8_scaling.scale_from_amax), exact."""
    return 1.0 / scale_from_amax(block_amax, fp8_max)


def _blocked(t: jax.Array, block: tuple[int, int]) -> jax.Array:
    """t [R, C] zero-padded to whole blocks -> [R/br, br, C/bc, bc]."""
    (r, c), (br, bc) = t.shape, block
    pr, pc = -r % br, -c % bc
    t = jnp.pad(t, ((0, pr), (0, pc)))
    return t.reshape((r + pr) // br, br, (c + pc) // bc, bc)


def _expand(d: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """d [R/br, C/bc] -> [R, C] (each block's factor on its values)."""
    full = jnp.repeat(jnp.repeat(d, block[0], axis=0), block[1], axis=1)
    return full[: shape[0], : shape[1]]


def quantize_blockwise(t: jax.Array, block: tuple[int, int], dtype) -> tuple[jax.Array, jax.Array]:
    """t [R, C] -> (q [R, C] in FP8 `dtype`, d [ceil(R/br), ceil(C/bc)] fp32 power-of-two factors):
    q = saturate(rne(t / d)) with d from each block's amax."""
    t32 = t.astype(jnp.float32)
    block_amax = jnp.max(jnp.abs(_blocked(t32, block)), axis=(1, 3))
    d = pow2_factor(block_amax, spec(dtype).max)
    bound = spec(dtype).max
    q = jnp.clip(t32 / _expand(d, block, t.shape), -bound, bound).astype(dtype)
    return q, d


def dequantize_blockwise(q: jax.Array, d: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """q * d in `dtype` (exact: a power-of-two d times an FP8 value), read through a table so that XLA cannot fold
    the FP8 rounding away (module docstring)."""
    lut = jnp.asarray(_LUT[jnp.dtype(q.dtype)])
    values = lut[jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)]
    return (values * _expand(d, block, q.shape)).astype(dtype)


def _dot(a, b, dims, dtype):
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32).astype(dtype)


_NN, _NT, _TN = ((1,), (0,)), ((1,), (1,)), ((0,), (0,))


@jax.custom_vjp
def fp8_dot_blockwise(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype with block-wise FP8 operands (module docstring's layout);
    straight-through gradients dx (dy 1x128 E5M2 @ W^T) and dW (x 128x1 E4M3 ^T @ dy 128x1 E5M2)."""
    return _blockwise_fwd(x, w)[0]


def _blockwise_fwd(x, w):
    dtype, x2 = x.dtype, _flat(x)
    x_q, x_d = quantize_blockwise(x2, ROW_TILE, E4M3)
    w_q, w_d = quantize_blockwise(w, BLOCK, E4M3)
    w_deq = dequantize_blockwise(w_q, w_d, BLOCK, dtype)
    y = _dot(dequantize_blockwise(x_q, x_d, ROW_TILE, dtype), w_deq, _NN, dtype)
    xt_q, xt_d = quantize_blockwise(x2, COL_TILE, E4M3)  # wgrad's layout, kept in FP8 for the backward
    return y.reshape(*x.shape[:-1], w.shape[-1]), (xt_q, xt_d, w_q, w_d, jnp.zeros((), w.dtype))


def _blockwise_bwd(res, g):
    xt_q, xt_d, w_q, w_d, w_dtype = res
    dtype, g2 = g.dtype, _flat(g)
    dx = _dgrad(g2, w_q, w_d, dtype)
    gt_q, gt_d = quantize_blockwise(g2, COL_TILE, E5M2)
    dw = _dot(dequantize_blockwise(xt_q, xt_d, COL_TILE, dtype), dequantize_blockwise(gt_q, gt_d, COL_TILE, dtype),
              _TN, dtype)
    return dx.reshape(*g.shape[:-1], w_q.shape[0]), dw.astype(w_dtype.dtype)


def _dgrad(g2, w_q, w_d, dtype):
    g_q, g_d = quantize_blockwise(g2, ROW_TILE, E5M2)
    return _dot(dequantize_blockwise(g_q, g_d, ROW_TILE, dtype), dequantize_blockwise(w_q, w_d, BLOCK, dtype),
                _NT, dtype)


fp8_dot_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


@jax.custom_vjp
def fp8_dot_blockwise_frozen(x: jax.Array, w_q: jax.Array, w_d: jax.Array) -> jax.Array:
    """x [..., K] @ W with W quantised once in 128 x 128 blocks (w_q [K, N] E4M3, w_d [K/128, N/128]); dx only."""
    return _bw_frozen_fwd(x, w_q, w_d)[0]


def _bw_frozen_fwd(x, w_q, w_d):
    dtype, x2 = x.dtype, _flat(x)
    x_q, x_d = quantize_blockwise(x2, ROW_TILE, E4M3)
    y = _dot(dequantize_blockwise(x_q, x_d, ROW_TILE, dtype), dequantize_blockwise(w_q, w_d, BLOCK, dtype), _NN,
             dtype)
    return y.reshape(*x.shape[:-1], w_q.shape[-1]), (w_q, w_d)


def _bw_frozen_bwd(res, g):
    w_q, w_d = res
    dx = _dgrad(_flat(g), w_q, w_d, g.dtype)
    return dx.reshape(*g.shape[:-1], w_q.shape[0]), jnp.zeros_like(w_q), jnp.zeros_like(w_d)


fp8_dot_blockwise_frozen.defvjp(_bw_frozen_fwd, _bw_frozen_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8BlockWeight:
    """A frozen kernel quantised once in 128 x 128 blocks: q [..., K, N] E4M3, d [..., K/128, N/128] fp32."""
    q: jax.Array
    d: jax.Array

    @classmethod
    def quantize(cls, w: jax.Array) -> "Fp8BlockWeight":
        """w [L, K, N] or [K, N]."""
        fn = lambda m: quantize_blockwise(m, BLOCK, E4M3)  # noqa: E731
        for _ in range(w.ndim - 2):
            fn = jax.vmap(fn)
        return cls(*fn(w))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)


__all__ = ["TILE", "ROW_TILE", "COL_TILE", "BLOCK", "pow2_factor", "quantize_blockwise", "dequantize_blockwise",
           "fp8_dot_blockwise", "fp8_dot_blockwise_frozen", "Fp8BlockWeight"]
