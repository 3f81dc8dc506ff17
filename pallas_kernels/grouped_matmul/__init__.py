"""Grouped matmul for dropless MoE: `schedule.py` (the row-tile schedule from group_sizes), `kernel.py` (Pallas /
Triton gmm and tgmm), `reference.py` (pure jnp), `api.py` (the public differentiable function), `gathered.py` (the
few-rows form: each assignment's expert gathered, then a row-by-row product). Imports nothing from surojax."""
from pallas_kernels.grouped_matmul.api import GMM_TILES, TGMM_TILES, grouped_dot, grouped_matmul
from pallas_kernels.grouped_matmul.gathered import gathered_dot, rowwise_dot
from pallas_kernels.grouped_matmul.kernel import GmmTiles, TgmmTiles, gmm, tgmm
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference, tgmm_reference

__all__ = ["GMM_TILES", "GmmTiles", "TGMM_TILES", "TgmmTiles", "gathered_dot", "gmm", "grouped_dot", "grouped_matmul",
           "grouped_matmul_reference", "rowwise_dot", "tgmm", "tgmm_reference"]
