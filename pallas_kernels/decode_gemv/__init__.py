"""The decode GEMV: a few rows (one token per running sequence) times a weight stored transposed [N, K], one Pallas
kernel per linear with an optional RMSNorm prologue and gated-product / residual epilogues: `kernel.py` (Pallas /
Triton: the tiles, the checks, the FMA body for M <= 8), `dot_kernel.py` (the tensor-core body, M <= 64),
`fused_ops.py` (the prologue / epilogue ops both share), `reference.py` (pure jnp), `api.py` (the public call and
the mode choice). Imports nothing from surojax."""
from pallas_kernels.decode_gemv.api import (MAX_DOT_ROWS, MAX_ROWS, GemvTiles, choose, converts, decode_gemv, tiles_for,
                                            weight_error)
from pallas_kernels.decode_gemv.reference import decode_gemv_ref

__all__ = ["MAX_DOT_ROWS", "MAX_ROWS", "GemvTiles", "choose", "converts", "decode_gemv", "decode_gemv_ref", "tiles_for",
           "weight_error"]
