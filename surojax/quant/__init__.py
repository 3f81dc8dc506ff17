"""Weight formats as JAX pytrees (see surojax.quant.base for the shape legend and the storage rule).

`FORMATS` maps a format name to its class; `quantize(w [K, N], fmt)` packs a kernel into that format;
every format has `dequantize(dtype) -> [K, N]`, `matmul(x)` and `nbytes`; those in FUSED_KERNEL_FORMATS also
`kernel_layout(kt)` for the fused kernels (pallas_kernels.quant_matmul).
"""
from __future__ import annotations

from surojax.quant.base import FORMATS, QuantFormat
from surojax.quant.gguf_base import GGUFQuant
from surojax.quant.gguf_float import BF16, F16, F32
from surojax.quant.gguf_legacy import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from surojax.quant.gguf_kquants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from surojax.quant.gguf_nonlinear import IQ4_NL, IQ4_XS, MXFP4
from surojax.quant.nf4 import NF4
from surojax.quant.fp8 import FP8Block
from surojax.quant.nvfp4 import NVFP4

GGUF_TYPES = {name: cls for name, cls in FORMATS.items() if issubclass(cls, GGUFQuant)}
# the formats the fused dequantise + matmul kernels decode (pallas_kernels.quant_matmul)
FUSED_KERNEL_FORMATS = frozenset(name for name, cls in FORMATS.items() if cls.kernel_spec is not None)


def quantize(w, fmt: str, **kw) -> QuantFormat:
    """Quantise a [K, N] kernel to the format named `fmt` (case-insensitive, e.g. "q4_k", "nf4")."""
    key = fmt.lower()
    if key not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[key].quantize(w, **kw)


__all__ = ["FORMATS", "FUSED_KERNEL_FORMATS", "GGUF_TYPES", "QuantFormat", "GGUFQuant", "quantize", "F32", "F16", "BF16", "Q4_0", "Q4_1",
           "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
           "NF4", "FP8Block", "NVFP4"]
