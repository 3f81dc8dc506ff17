"""The gathered GEMV: a MoE call's few assignment rows, each times its routed expert's weight read in place from the
stacked [E, I, O] experts (no gathered copy), one Pallas kernel: `kernel.py` (Pallas / Triton), `api.py` (the
public call and the mode choice). The reference is XLA's gather + product, pallas_kernels.grouped_matmul.gathered.
Imports nothing from surojax."""
from pallas_kernels.gathered_gemv.api import MODES, GatheredTiles, choose, gathered_gemv

__all__ = ["MODES", "GatheredTiles", "choose", "gathered_gemv"]
