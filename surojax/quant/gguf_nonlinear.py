"""GGUF types with a non-uniform 4-bit code book (a 16-entry table indexed by each nibble):

  IQ4_NL   18 B per 32 values: d fp16 | qs[16]; x[i] = d * KVALUES_IQ4NL[q[i]],
           q[i] = qs[i] & 15, q[i+16] = qs[i] >> 4
  IQ4_XS  136 B per 256 values: d fp16 | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of 32,
           ls[j] = ((scales_l[j/2] >> 4*(j%2)) & 15 | ((scales_h >> 2j) & 3) << 4) - 32,
           x = d * ls[j] * KVALUES_IQ4NL[q], nibbles of qs[16j .. 16j+16] as IQ4_NL
  MXFP4    17 B per 32 values: e u8 (E8M0) | qs[16]; x = e8m0_half(e) * KVALUES_MXFP4[q],
           KVALUES_MXFP4 = the E2M1 values doubled, e8m0_half(e) = 2^(e-128) (ggml_e8m0_to_fp32_half);
           q[i] = qs[i] & 15, q[i+16] = qs[i] >> 4. The same values as the OCP Microscaling spec's MXFP4
           (E2M1 x 2^(e-127)), which is how gpt-oss's published `_blocks` / `_scales` experts load packed
           (surojax.weights.mxfp4_checkpoint reorders their bytes into these blocks). One difference in
           bits: ggml's table has no -0, so code 8 decodes to +0; `negative_zero=True` (the gpt-oss load)
           decodes it to -0.0 as the spec and transformers do.

Quantisation: IQ4_NL / IQ4_XS by llama.cpp's algorithm in quantize_iq4.py (byte-exact); MXFP4 by gguf.quants.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from surojax.quant.base import f16_from_bytes, nibbles_lo_hi, register_format, static, u16_from_bytes
from surojax.quant.gguf_base import QK_K, GGUFQuant

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


@register_format("iq4_nl")
class IQ4_NL(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 20, 32, 18, True

    @classmethod
    def dequantize_blocks(cls, b):
        d = f16_from_bytes(b[:, 0:2])[:, None]
        q = nibbles_lo_hi(b[:, 2:]).reshape(b.shape[0], 32)
        return d * jnp.asarray(KVALUES_IQ4NL)[q]


@register_format("iq4_xs")
class IQ4_XS(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 23, QK_K, 136, True

    @classmethod
    def dequantize_blocks(cls, b):
        n = b.shape[0]
        d = f16_from_bytes(b[:, 0:2])[:, None]
        sh = u16_from_bytes(b[:, 2:4])[:, None] >> (2 * jnp.arange(8, dtype=jnp.uint16))
        sl = (b[:, 4:8].reshape(n, 4, 1) >> jnp.asarray([0, 4], jnp.uint8).reshape(1, 1, 2)).reshape(n, 8)
        ls = ((sl & 0x0F).astype(jnp.int32) | ((sh & 3).astype(jnp.int32) << 4)) - 32
        dl = (d * ls.astype(jnp.float32)).reshape(n, 8, 1)
        q = nibbles_lo_hi(b[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32)
        return (dl * jnp.asarray(KVALUES_IQ4NL)[q]).reshape(n, QK_K)


def _mxfp4_bits(e: jax.Array, q: jax.Array, negative_zero: bool = False) -> jax.Array:
    """float32 bits of e8m0_half(e) * KVALUES_MXFP4[q], built with integer ops (code 8: +0, or -0.0 with
    `negative_zero`).

    The product is exact (a power of two times |k| in {1, 2, 3, 4, 6, 8, 12}), but for e < 2 it can be an fp32
    subnormal, which XLA:CPU flushes to zero in float arithmetic. Building the bits directly keeps it bit-exact
    with ggml: |k| = m * 2^s with m in {1, 3}; value = (1 + (m == 3) / 2) * 2^(e - 128 + s + (m == 3)).
    """
    q = q.astype(jnp.int32)
    mag = q & 7                                             # index into 0, 1, 2, 3, 4, 6, 8, 12
    s = jnp.asarray([0, 0, 1, 0, 2, 1, 3, 2], jnp.int32)[mag]
    three = jnp.asarray([0, 0, 0, 1, 0, 1, 0, 1], jnp.int32)[mag]
    be = e.astype(jnp.int32)[:, None] - 128 + s + three + 127  # biased fp32 exponent
    frac = three << 22
    normal = (be << 23) | frac
    sub = ((1 << 23) | frac) >> jnp.clip(1 - be, 0, 31)     # be in {-1, 0}: shift by 2 or 1, exact
    bits = jnp.where(be >= 1, normal, sub)
    bits = jnp.where(be >= 255, 0x7F800000, bits)
    sign = (q & 8) << 28
    bits = jnp.where(mag == 0, sign if negative_zero else 0, bits | sign)  # ggml: +0 for both zero codes
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


@register_format("mxfp4")
class MXFP4(GGUFQuant):
    negative_zero: bool = static(default=False)  # code 8 as -0.0 (OCP, gpt-oss) instead of ggml's +0

    ggml_type, block_size, type_size, can_quantize = 39, 32, 17, True

    @classmethod
    def from_blocks_scales(cls, blocks: np.ndarray, scales: np.ndarray) -> "MXFP4":
        """The OCP MXFP4 pair as gpt-oss publishes it (`_blocks` [..., N, K/32, 16] uint8, byte j of a block holding
        element 2j in its low and 2j + 1 in its high nibble; `_scales` [..., N, K/32] uint8 E8M0) -> this format
        with the same values (negative_zero=True), data [..., N, K/32 * 17]: only the bytes are reordered."""
        blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16 or blocks.ndim < 3:
            raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
                             "(expected blocks [..., N, K/32, 16] and scales [..., N, K/32])")
        codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, 32)  # element order
        block = np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
        n, groups = scales.shape[-2:]
        return cls(data=np.ascontiguousarray(block.reshape(*scales.shape[:-1], groups * cls.type_size)),
                   shape=(groups * cls.block_size, n), negative_zero=True)

    def dequantize_blocks(self, b):  # per instance (GGUFQuant.dequantize calls it on self): negative_zero
        q = nibbles_lo_hi(b[:, 1:]).reshape(b.shape[0], 32)
        return _mxfp4_bits(b[:, 0], q, self.negative_zero)
