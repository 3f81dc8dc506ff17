"""GGUF K-quants: super-blocks of QK_K = 256 values along K. Byte layout of one super-block (llama.cpp
`block_q*_K`, little-endian, fp16 = IEEE half), and the decoding that gguf.quants / ggml perform:

  Q2_K   84 B: scales[16] | qs[64] | d fp16 | dmin fp16
         16 sub-blocks of 16: x = d*(sc & 15) * q - dmin*(sc >> 4), q 2-bit: qs[32*h + l] >> 2*s (h<2, s<4)
  Q3_K  110 B: hmask[32] | qs[64] | scales[12] | d fp16
         16 sub-blocks of 16: x = d*(sc - 32) * (q2 - 4*(1 - hbit)); 6-bit sc: low nibbles in bytes 0..7,
         high 2-bit pairs in bytes 8..11; hbit j of hmask[l] belongs to value 32*j + l
  Q4_K  144 B: d fp16 | dmin fp16 | scales[12] | qs[128]
         8 sub-blocks of 32: x = d*sc * q - dmin*m, 6-bit sc/m packed in 12 bytes (get_scale_min_k4),
         q = nibble s of qs[32*i + l] for sub-block 2*i + s
  Q5_K  176 B: d fp16 | dmin fp16 | scales[12] | qh[32] | qs[128]
         as Q4_K with a fifth bit: bit j of qh[l] for sub-block j
  Q6_K  210 B: ql[128] | qh[64] | scales[16] int8 | d fp16
         16 sub-blocks of 16: x = d*sc * (q - 32), q = low nibble from ql | 2 high bits from qh

Quantisation: llama.cpp's reference quantisers (quantize_row_q*_K_ref), byte-exact, in quantize_kquants.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul.layout import LayoutSpec, decode_integer
from surojax.quant.base import f16_from_bytes, register_format
from surojax.quant.gguf_base import QK_K, GGUFQuant


def _shifts(*s):
    return jnp.asarray(s, dtype=jnp.uint8)


def _shift_out(x, shifts, mask, axis_shape):
    """x uint8 [M, ...] broadcast against shifts placed at axis_shape -> (x >> shifts) & mask."""
    return (x >> shifts.reshape(axis_shape)) & mask


def _scale_min_k4(scales):
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> (sc, m) int32 [M, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.int32), mn.astype(jnp.int32)


def _k4_scales_mins(b):
    """Q4_K/Q5_K super-block header (d fp16 | dmin fp16 | 12 bytes of 6-bit scales and mins), uint8 [M, >= 16]
    -> d*sc, dmin*m float32 [M, 8, 1] (one per sub-block of 32)."""
    n = b.shape[0]
    d, dmin = f16_from_bytes(b[:, 0:2])[:, None], f16_from_bytes(b[:, 2:4])[:, None]
    sc, m = _scale_min_k4(b[:, 4:16])
    return (d * sc.astype(jnp.float32)).reshape(n, 8, 1), (dmin * m.astype(jnp.float32)).reshape(n, 8, 1)


def _k4_kernel_scales(b):
    """Q4_K/Q5_K super-blocks uint8 [N, nb, type_size] -> (d*sc, dmin*m) float32 [N, nb*8] (sub-block order)."""
    n, nb = b.shape[:2]
    d, dmin = f16_from_bytes(b[..., 0:2])[..., None], f16_from_bytes(b[..., 2:4])[..., None]
    sc, m = (a.reshape(n, nb, 8) for a in _scale_min_k4(b[..., 4:16].reshape(-1, 12)))
    return (d * sc.astype(jnp.float32)).reshape(n, -1), (dmin * m.astype(jnp.float32)).reshape(n, -1)


@register_format("q2_k")
class Q2_K(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 10, QK_K, 84, True

    @classmethod
    def dequantize_blocks(cls, b):
        n = b.shape[0]
        scales, qs = b[:, :16], b[:, 16:80]
        d, dmin = f16_from_bytes(b[:, 80:82])[:, None], f16_from_bytes(b[:, 82:84])[:, None]
        dl = (d * (scales & 0xF).astype(jnp.float32)).reshape(n, 16, 1)
        ml = (dmin * (scales >> 4).astype(jnp.float32)).reshape(n, 16, 1)
        q = _shift_out(qs.reshape(n, 2, 1, 32), _shifts(0, 2, 4, 6), 3, (1, 1, 4, 1))
        q = q.reshape(n, 16, 16).astype(jnp.float32)
        return (dl * q - ml).reshape(n, QK_K)


@register_format("q3_k")
class Q3_K(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 11, QK_K, 110, True

    @classmethod
    def dequantize_blocks(cls, b):
        n = b.shape[0]
        hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
        d = f16_from_bytes(b[:, 108:110])[:, None]
        lo = _shift_out(scales[:, :8].reshape(n, 1, 8), _shifts(0, 4), 0x0F, (1, 2, 1)).reshape(n, 16)
        hi = _shift_out(scales[:, 8:].reshape(n, 1, 4), _shifts(0, 2, 4, 6), 0x03, (1, 4, 1)).reshape(n, 16)
        sc = ((lo | (hi << 4)).astype(jnp.int32) - 32).astype(jnp.float32)
        dl = (d * sc).reshape(n, 16, 1)
        ql = _shift_out(qs.reshape(n, 2, 1, 32), _shifts(0, 2, 4, 6), 3, (1, 1, 4, 1)).reshape(n, 16, 16)
        qh = _shift_out(hmask.reshape(n, 1, 1, 32), jnp.arange(8, dtype=jnp.uint8), 1, (1, 1, 8, 1))
        qh = qh.reshape(n, 16, 16) ^ 1  # the -4 offset applies when the mask bit is 0
        q = (ql.astype(jnp.int32) - (qh.astype(jnp.int32) << 2)).astype(jnp.float32)
        return (dl * q).reshape(n, QK_K)


@register_format("q4_k")
class Q4_K(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 12, QK_K, 144, True

    @classmethod
    def dequantize_blocks(cls, b):
        n = b.shape[0]
        dd, dm = _k4_scales_mins(b)
        q = _shift_out(b[:, 16:].reshape(n, 4, 1, 32), _shifts(0, 4), 0x0F, (1, 1, 2, 1))
        q = q.reshape(n, 8, 32).astype(jnp.float32)
        return (dd * q - dm).reshape(n, QK_K)

    kernel_spec = LayoutSpec("q4_k", nibble=True, group=32, has_offset=True, decode=decode_integer)

    def kernel_values(self):
        """codes 0..15, scale d*sc and offset dmin*m per sub-block of 32."""
        b = self.row_blocks()
        n, nb = b.shape[:2]
        scale, offset = _k4_kernel_scales(b)
        qs = b[..., 16:].reshape(n, nb, 4, 1, 32)                   # byte 32*i + l: sub-blocks 2i (lo), 2i+1 (hi)
        codes = ((qs >> _shifts(0, 4).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(n, -1)
        return codes, scale, offset


@register_format("q5_k")
class Q5_K(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 13, QK_K, 176, True

    @classmethod
    def dequantize_blocks(cls, b):
        n = b.shape[0]
        dd, dm = _k4_scales_mins(b)
        ql = _shift_out(b[:, 48:].reshape(n, 4, 1, 32), _shifts(0, 4), 0x0F, (1, 1, 2, 1)).reshape(n, 8, 32)
        qh = _shift_out(b[:, 16:48].reshape(n, 1, 1, 32), jnp.arange(8, dtype=jnp.uint8), 1, (1, 1, 8, 1))
        q = (ql | (qh.reshape(n, 8, 32) << 4)).astype(jnp.float32)
        return (dd * q - dm).reshape(n, QK_K)

    kernel_spec = LayoutSpec("q5_k", nibble=False, group=32, has_offset=True, decode=decode_integer)

    def kernel_values(self):
        """codes 0..31 (one per byte), scale d*sc and offset dmin*m per sub-block of 32."""
        b = self.row_blocks()
        n, nb = b.shape[:2]
        scale, offset = _k4_kernel_scales(b)
        qs = b[..., 48:].reshape(n, nb, 4, 1, 32)
        lo = (qs >> _shifts(0, 4).reshape(1, 1, 1, 2, 1)) & 0x0F                        # [n, nb, 4, 2, 32]
        qh = b[..., 16:48].reshape(n, nb, 1, 32)                                       # bit j of qh[l]: sub-block j
        hi = (qh >> jnp.arange(8, dtype=jnp.uint8).reshape(1, 1, 8, 1)) & 1            # [n, nb, 8, 32]
        codes = (lo.reshape(n, nb, 8, 32) | (hi << 4)).reshape(n, -1)
        return codes, scale, offset


@register_format("q6_k")
class Q6_K(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 14, QK_K, 210, True

    @classmethod
    def dequantize_blocks(cls, b):
        n = b.shape[0]
        ql, qh = b[:, :128], b[:, 128:192]
        scales = jax.lax.bitcast_convert_type(b[:, 192:208], jnp.int8).astype(jnp.float32)
        d = f16_from_bytes(b[:, 208:210])[:, None]
        dl = (d * scales).reshape(n, 16, 1)
        lo = _shift_out(ql.reshape(n, 2, 1, 64), _shifts(0, 4), 0x0F, (1, 1, 2, 1)).reshape(n, 8, 32)
        hi = _shift_out(qh.reshape(n, 2, 1, 32), _shifts(0, 2, 4, 6), 0x03, (1, 1, 4, 1)).reshape(n, 8, 32)
        q = ((lo | (hi << 4)).astype(jnp.int32) - 32).reshape(n, 16, 16).astype(jnp.float32)
        return (dl * q).reshape(n, QK_K)

    kernel_spec = LayoutSpec("q6_k", nibble=False, group=16, has_offset=False, decode=decode_integer)

    def kernel_values(self):
        """codes q - 32 as int8, scale d*sc per sub-block of 16."""
        b = self.row_blocks()
        n, nb = b.shape[:2]
        ql, qh = b[..., :128].reshape(n, nb, 2, 1, 64), b[..., 128:192].reshape(n, nb, 2, 1, 32)
        sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
        scale = (f16_from_bytes(b[..., 208:210])[..., None] * sc).reshape(n, -1)      # [N, K/16]
        lo = (ql >> _shifts(0, 4).reshape(1, 1, 1, 2, 1)) & 0x0F                      # [n, nb, 2, 2, 64]
        hi = (qh >> _shifts(0, 2, 4, 6).reshape(1, 1, 1, 4, 1)) & 0x03                # [n, nb, 2, 4, 32]
        q = (lo.reshape(n, nb, 256) | (hi.reshape(n, nb, 256) << 4)).astype(jnp.int32) - 32
        return q.astype(jnp.int8).reshape(n, -1), scale, None
