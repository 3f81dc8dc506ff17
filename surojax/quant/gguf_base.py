"""GGUF (llama.cpp / ggml) tensor types as pytrees: the raw block bytes, exactly as a .gguf file stores them.

Layout mapping. ggml stores a 2-D weight row-major as [rows = N (out), cols = K (in)], quantised in blocks of
`block_size` consecutive values along K; each block is `type_size` bytes. A quantised tensor is therefore the
uint8 array `data [N, K // block_size * type_size]` (what `gguf.GGUFReader` returns as `tensor.data`), and our
[K, N] kernel is its transpose: `dequantize()` decodes to [N, K] and transposes; `quantize(w [K, N])` quantises
`w.T`. (ggml lists dimensions innermost first, so the file's `ne` is [K, N].) Leading dims on `data` pass through.

Dequantisation mirrors `gguf.quants` (the reference, llama.cpp's `dequantize_row_*`) operation by operation in
float32, so it is bit-exact against `gguf.quants.dequantize` on CPU (tests/quant/test_gguf.py). One caveat for
other backends: a compiler that contracts `d * q - m` into an FMA rounds once instead of twice; XLA:CPU does not.

Quantisation uses `gguf.quants.quantize`, which implements (bit-exact with ggml's reference quantisers):
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, BF16, F16, F32; Q2_K..Q6_K use surojax.quant.quantize_kquants and IQ4_NL /
IQ4_XS surojax.quant.quantize_iq4 (llama.cpp's quantisers without importance matrix, byte-exact).
`gguf` is imported lazily: dequantisation does not need it (the GPU image lacks the package).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from surojax.quant import quantize_iq4, quantize_kquants
from surojax.quant.base import QuantFormat, as_kn, static, to_kn

QK_K = 256  # super-block size of the K-quants and IQ4_XS


@dataclasses.dataclass(frozen=True)
class GGUFQuant(QuantFormat):
    """Base of every GGUF type. data: [..., N, K // block_size * type_size] in `storage_dtype` (uint8 for the
    block-quantised types); shape: (K, N) static."""

    data: jax.Array
    shape: tuple[int, int] = static()

    ggml_type: ClassVar[int]          # GGMLQuantizationType value
    block_size: ClassVar[int]         # values per block (along K)
    type_size: ClassVar[int]          # bytes per block
    storage_dtype: ClassVar = np.uint8
    can_quantize: ClassVar[bool] = False

    @classmethod
    def bytes_per_value(cls) -> float:
        return cls.type_size / cls.block_size

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, raw: np.ndarray, k: int, n: int) -> "GGUFQuant":
        """Wrap a tensor read from a .gguf file (`ne = [K, N]`) without conversion."""
        if k % cls.block_size:
            raise ValueError(f"{cls.name}: K={k} is not a multiple of the block size {cls.block_size}")
        row = k // cls.block_size * cls.type_size // np.dtype(cls.storage_dtype).itemsize
        data = np.ascontiguousarray(raw).view(cls.storage_dtype).reshape(n, row)
        return cls(data=jnp.asarray(data), shape=(k, n))

    @classmethod
    def quantize(cls, w, **kw) -> "GGUFQuant":
        w = as_kn(w)
        k, n = w.shape
        if k % cls.block_size:
            raise ValueError(f"{cls.name}: K={k} (the input dim) must be a multiple of {cls.block_size}")
        if not cls.can_quantize:
            raise NotImplementedError(
                f"quantising to GGUF {cls.name} is not implemented yet: the gguf package has no quantiser for it "
                "(llama.cpp's reference quantiser is to come); it can be dequantised, so wrap pre-quantised "
                f"tensors with {cls.__name__}.from_gguf")
        for impl in (quantize_kquants, quantize_iq4):  # llama.cpp's reference quantisers, byte-exact
            if cls.name in impl.BLOCK_QUANTIZERS:
                return cls.from_gguf(impl.quantize_rows(w.T, cls.name), k, n)
        import gguf  # lazy: only quantisation needs the package
        raw = gguf.quants.quantize(np.ascontiguousarray(w.T), gguf.GGMLQuantizationType(cls.ggml_type))
        return cls.from_gguf(np.asarray(raw), k, n)

    # -- decoding -----------------------------------------------------------------------------------------------
    def row_blocks(self) -> jax.Array:
        """One layer's uint8 data as [N, K / block_size, type_size]: block b of output row n."""
        k, n = self.shape
        return jnp.asarray(self.data).reshape(n, k // self.block_size, self.type_size)

    @classmethod
    def dequantize_blocks(cls, blocks: jax.Array) -> jax.Array:
        """uint8 [M, type_size] -> float32 [M, block_size]."""
        raise NotImplementedError

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        k, n = self.shape
        data = jnp.asarray(self.data)
        lead = data.shape[:-2]
        vals = self.dequantize_blocks(data.reshape(-1, self.type_size))
        return to_kn(vals.reshape(*lead, n, k), dtype)
