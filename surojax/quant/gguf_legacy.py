"""GGUF legacy block types (32 values per block along K). Byte layout of one block, little-endian, as llama.cpp's
`block_q*` structs (fp16 = IEEE half):

  Q4_0  18 B: d fp16 | qs[16]           x[i] = d * (q[i] - 8);   q[i] = qs[i] & 15, q[i+16] = qs[i] >> 4
  Q4_1  20 B: d fp16 | m fp16 | qs[16]  x[i] = d * q[i] + m;     nibbles as Q4_0
  Q5_0  22 B: d fp16 | qh u32 | qs[16]  x[i] = d * (q[i] - 16);  q[i] = nibble | ((qh >> i) & 1) << 4
  Q5_1  24 B: d fp16 | m fp16 | qh u32 | qs[16]   x[i] = d * q[i] + m
  Q8_0  34 B: d fp16 | qs[32] int8      x[i] = d * qs[i]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul.layout import LayoutSpec, decode_integer
from surojax.quant.base import f16_from_bytes, nibbles_lo_hi, register_format, u32_from_bytes
from surojax.quant.gguf_base import GGUFQuant


def _nibbles32(qs):
    """qs uint8 [M, 16] -> int32 [M, 32] (low nibbles are values 0..15, high nibbles 16..31)."""
    return nibbles_lo_hi(qs).reshape(qs.shape[0], 32).astype(jnp.int32)


def _high_bits32(qh):
    """qh uint8 [M, 4] (a little-endian u32) -> int32 [M, 32] with bit i of the u32 in column i."""
    bits = (u32_from_bytes(qh)[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.astype(jnp.int32)


@register_format("q4_0")
class Q4_0(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 2, 32, 18, True

    @classmethod
    def dequantize_blocks(cls, b):
        d = f16_from_bytes(b[:, 0:2])[:, None]
        return d * (_nibbles32(b[:, 2:]) - 8).astype(jnp.float32)


@register_format("q4_1")
class Q4_1(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 3, 32, 20, True

    @classmethod
    def dequantize_blocks(cls, b):
        d, m = f16_from_bytes(b[:, 0:2])[:, None], f16_from_bytes(b[:, 2:4])[:, None]
        return d * _nibbles32(b[:, 4:]).astype(jnp.float32) + m


@register_format("q5_0")
class Q5_0(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 6, 32, 22, True

    @classmethod
    def dequantize_blocks(cls, b):
        d = f16_from_bytes(b[:, 0:2])[:, None]
        q = _nibbles32(b[:, 6:]) | (_high_bits32(b[:, 2:6]) << 4)
        return d * (q - 16).astype(jnp.float32)


@register_format("q5_1")
class Q5_1(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 7, 32, 24, True

    @classmethod
    def dequantize_blocks(cls, b):
        d, m = f16_from_bytes(b[:, 0:2])[:, None], f16_from_bytes(b[:, 2:4])[:, None]
        q = _nibbles32(b[:, 8:]) | (_high_bits32(b[:, 4:8]) << 4)
        return d * q.astype(jnp.float32) + m


@register_format("q8_0")
class Q8_0(GGUFQuant):
    ggml_type, block_size, type_size, can_quantize = 8, 32, 34, True

    @classmethod
    def dequantize_blocks(cls, b):
        d = f16_from_bytes(b[:, 0:2])[:, None]
        return jax.lax.bitcast_convert_type(b[:, 2:], jnp.int8).astype(jnp.float32) * d

    kernel_spec = LayoutSpec("q8_0", nibble=False, group=32, has_offset=False, decode=decode_integer)

    def kernel_values(self):
        """codes int8, scale d per block of 32."""
        b = self.row_blocks()
        n = b.shape[0]
        scale = f16_from_bytes(b[..., 0:2]).reshape(n, -1)                             # [N, K/32]
        q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).reshape(n, -1)
        return q, scale, None
