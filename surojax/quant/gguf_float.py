"""GGUF unquantised types F32, F16, BF16 (block size 1).

data: [..., N, K] row-major as in the file: F32 float32, F16 float16, BF16 uint16 (the raw bf16 bits, decoded
as `bits << 16` reinterpreted as float32, which is what ggml and gguf.quants do, NaN payloads included).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from surojax.quant.base import register_format
from surojax.quant.gguf_base import GGUFQuant


@register_format("f32")
class F32(GGUFQuant):
    ggml_type, block_size, type_size, storage_dtype, can_quantize = 0, 1, 4, np.float32, True

    @classmethod
    def dequantize_blocks(cls, blocks):
        return blocks.astype(jnp.float32)

    def dequantize(self, dtype=jnp.bfloat16):
        return jnp.swapaxes(jnp.asarray(self.data), -1, -2).astype(dtype)


@register_format("f16")
class F16(F32):
    ggml_type, block_size, type_size, storage_dtype, can_quantize = 1, 1, 2, np.float16, True


@register_format("bf16")
class BF16(F32):
    ggml_type, block_size, type_size, storage_dtype, can_quantize = 30, 1, 2, np.uint16, True

    def dequantize(self, dtype=jnp.bfloat16):
        bits = jnp.asarray(self.data).astype(jnp.uint32) << 16
        return jnp.swapaxes(jax.lax.bitcast_convert_type(bits, jnp.float32), -1, -2).astype(dtype)
