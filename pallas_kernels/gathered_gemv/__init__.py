"""The gathered GEMV: a MoE call's few assignment rows, each times its routed expert's weight read in place from the
stacked [E, I, O] experts (no gathered copy), one Pallas kernel: `kernel.py` (Pallas / Triton), `api.py` (the
public call and the mode choice). The reference is XLA's gather + product, pallas_kernels.grouped_matmul.gathered.
Quantised experts in the fused kernels' layout: `quant_kernel.py`, its reference `reference.py`.
Imports nothing from surojax."""
from pallas_kernels.gathered_gemv.api import (MODES, GatheredTiles, QuantGatheredTiles, choose, gathered_gemv,
                                              gathered_quant_gemv)

__all__ = ["MODES", "GatheredTiles", "QuantGatheredTiles", "choose", "gathered_gemv", "gathered_quant_gemv"]
