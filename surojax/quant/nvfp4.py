"""NVFP4: E2M1 values, one E4M3 scale per 16 consecutive values along K, one fp32 scale per tensor
(NVIDIA's Blackwell block format, as ModelOpt / TensorRT checkpoints store it; emulated in jnp elsewhere).

  data          uint8         [..., N, K/2]    two E2M1 codes per byte, the EVEN element in the LOW nibble;
                                               code bits s e e m: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
  scale         float8_e4m3fn [..., N, K/16]   per-block scale          (ModelOpt `weight_scale`)
  global_scale  float32       [...]            per-tensor scale          (ModelOpt `weight_scale_2`)
  decode: x = E2M1[q] * (float32(scale) * global_scale)

Quantisation: global_scale = amax / (6 * 448) so that the largest block scale is exactly E4M3's max;
scale = E4M3(block_amax / 6 / global_scale) (round to nearest even); q = E2M1(w / (scale * global_scale))
(round to nearest even, clipped to +-6). Error bound per value: |w - deq| <= scale * global_scale (a whole E2M1
step at the top binade covers both the half-step rounding and the clipping after the scale rounded down).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.quant_matmul.layout import LayoutSpec, e2m1
from surojax.quant.base import QuantFormat, as_kn, register_format, static, to_kn

BLOCK = 16
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@register_format("nvfp4")
class NVFP4(QuantFormat):
    data: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    shape: tuple[int, int] = static(default=(0, 0))

    kernel_spec = LayoutSpec("nvfp4", nibble=True, group=BLOCK, has_offset=False, decode=e2m1)

    @classmethod
    def bytes_per_value(cls) -> float:
        return 0.5 + 1 / BLOCK  # a 4-bit code, and an E4M3 scale per 16 values

    @classmethod
    def quantize(cls, w) -> "NVFP4":
        w = as_kn(w)
        k, n = w.shape
        if k % BLOCK:
            raise ValueError(f"nvfp4: K={k} (the input dim) must be a multiple of {BLOCK}")
        wt = np.ascontiguousarray(w.T).reshape(n, k // BLOCK, BLOCK)
        amax = np.float32(np.abs(wt).max())
        g = np.float32(amax / np.float32(6 * 448)) if amax > 0 else np.float32(1)
        bamax = np.abs(wt).max(-1)
        s = np.clip(bamax / np.float32(6) / g, 0, 448).astype(ml_dtypes.float8_e4m3fn)
        eff = s.astype(np.float32) * g
        with np.errstate(divide="ignore", invalid="ignore"):
            x = np.where(eff[..., None] > 0, wt / eff[..., None], 0)
        q = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(n, k) & 0x0F
        data = q[:, 0::2] | (q[:, 1::2] << 4)
        return cls(data=jnp.asarray(data), scale=jnp.asarray(s), global_scale=jnp.asarray(g, jnp.float32),
                   shape=(k, n))

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        k, n = self.shape
        data = jnp.asarray(self.data)
        lead = data.shape[:-2]
        q = jnp.stack([data & 0x0F, data >> 4], axis=-1).reshape(*lead, n, k // BLOCK, BLOCK)
        eff = jnp.asarray(self.scale).astype(jnp.float32) * jnp.asarray(self.global_scale)[..., None, None]
        vals = jnp.asarray(E2M1_VALUES)[q.astype(jnp.int32)] * eff[..., None]
        return to_kn(vals.reshape(*lead, n, k), dtype)

    def kernel_values(self):
        """codes 0..15 (the even value of a byte is its LOW nibble), scale = float32(scale) * global_scale."""
        k, n = self.shape
        data = jnp.asarray(self.data)
        codes = jnp.stack([data & 0x0F, data >> 4], axis=-1).reshape(n, k)
        eff = jnp.asarray(self.scale).astype(jnp.float32) * jnp.asarray(self.global_scale)
        return codes, eff, None
