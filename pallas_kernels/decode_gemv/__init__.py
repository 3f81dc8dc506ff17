"""The decode GEMV: a few rows (one token per running sequence) times a weight stored transposed [N, K], one Pallas
kernel per linear with an optional RMSNorm prologue and gated-product / residual epilogues: `kernel.py` (Pallas /
Triton), `reference.py` (pure jnp), `api.py` (the public call and the mode choice). Imports nothing from surojax."""
from pallas_kernels.decode_gemv.api import MAX_ROWS, GemvTiles, choose, converts, decode_gemv, tiles_for, weight_error
from pallas_kernels.decode_gemv.reference import decode_gemv_ref

__all__ = ["MAX_ROWS", "GemvTiles", "choose", "converts", "decode_gemv", "decode_gemv_ref", "tiles_for",
           "weight_error"]
