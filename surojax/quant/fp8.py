"""FP8 E4M3 weights with one fp32 scale per block of the [N, K] weight (the DeepSeek-V3 / Qwen3-FP8 "block-wise FP8"
layout, and every other FP8 weight scaling as a block shape).

  data   float8_e4m3fn [..., N, K]                         (HF `weight`, torch layout [out, in])
  scale  float32       [..., ceil(N/bn), ceil(K/bk)]        (HF `weight_scale_inv`: x = data * scale)
  block  (bn, bk)      static, default (128, 128)          rows of N and columns of K that share one scale

Block choice when quantising: 128 x 128 over the weight (both N and K), not 1 x 128. It is what the public FP8
checkpoints ship for weights (1 x 128 is their activation granularity), so those load without requantising, the
scales cost 1/16384 of the weights, and a [128 x 128] tile of a Pallas GEMM needs exactly one scale.
Quantisation: scale = block absmax / 448 (1 for an all-zero block), data = round-to-nearest-even E4M3 of
w / scale. Error bound per value: |w - deq| <= 2^-4 |w| + 2^-10 scale (half an E4M3 ulp; 2^-10 covers the
subnormal range).

Other block shapes hold other published FP8 scalings exactly, as they are stored (surojax.weights.prequant): one
scale per tensor is block (N, K) with scale [1, 1]; per output channel (1, K), scale [N, 1]; groups of g along K
(1, g); compressed-tensors' and transformers' [bn, bk] blocks as they are. The last block of an axis may be partial
(ceil). Dequantisation is data * scale in float32 (exact: a 4-bit by 24-bit significand product), then one rounding
to the asked dtype. The fused kernels read one scale per 128 values of a row, so they take blocks with bk a
multiple of 128 (the scale repeated along K); others run the XLA path (`kernel_layout_error` says why).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.quant_matmul.layout import LayoutSpec, decode_integer
from surojax.quant.base import QuantFormat, as_kn, register_format, static, to_kn

BLOCK = 128
E4M3_MAX = 448.0


@register_format("fp8")
class FP8Block(QuantFormat):
    data: jax.Array
    scale: jax.Array
    shape: tuple[int, int] = static(default=(0, 0))
    block: tuple[int, int] = static(default=(BLOCK, BLOCK))

    kernel_spec = LayoutSpec("fp8", nibble=False, group=BLOCK, has_offset=False, decode=decode_integer)

    @classmethod
    def bytes_per_value(cls) -> float:
        return 1 + 4 / BLOCK ** 2  # a code, and an fp32 scale per 128 x 128 block (checkpoints' smaller blocks: ~1)

    @classmethod
    def quantize(cls, w) -> "FP8Block":
        w = as_kn(w)
        k, n = w.shape
        wt = np.ascontiguousarray(w.T)
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = np.pad(wt, ((0, nb * BLOCK - n), (0, kb * BLOCK - k)))
        amax = np.abs(padded.reshape(nb, BLOCK, kb, BLOCK)).max(axis=(1, 3))
        scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), 1).astype(np.float32)
        full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:n, :k]
        q = np.clip(wt / full, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
        return cls(data=jnp.asarray(q), scale=jnp.asarray(scale), shape=(k, n))

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        k, n = self.shape
        bn, bk = self.block
        s = jnp.repeat(jnp.repeat(jnp.asarray(self.scale), bn, axis=-2), bk, axis=-1)[..., :n, :k]
        return to_kn(jnp.asarray(self.data).astype(jnp.float32) * s, dtype)

    def kernel_layout_error(self, kt: int) -> str | None:
        if self.block[1] % BLOCK:
            return (f"fp8: the fused kernel reads one scale per {BLOCK} values of a row; this weight's scale blocks "
                    f"are {self.block[1]} wide along K")
        return super().kernel_layout_error(kt)

    def kernel_values(self):
        """codes E4M3, scale = each row's block scales repeated to one per 128 values of K: [N, ceil(K/128)]."""
        k, n = self.shape
        bn, bk = self.block
        scale = jnp.repeat(jnp.repeat(jnp.asarray(self.scale), bn, axis=0)[:n], bk // BLOCK, axis=1)
        return jnp.asarray(self.data), scale[:, :-(-k // BLOCK)], None
