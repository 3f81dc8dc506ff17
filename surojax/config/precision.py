"""Precision keys: the compute recipe and the dtypes of gradients and master weights."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from surojax.config.base import StrictModel

Recipe = Literal["bf16", "fp32", "fp8_hybrid", "nvfp4"]
Fp8Scaling = Literal["current", "delayed", "blockwise"]
AmaxAlgo = Literal["max", "most_recent"]
FloatDtype = Literal["fp32", "bf16"]


class PrecisionSection(StrictModel):
    recipe: Recipe = "bf16"
    """Matmul precision: bf16, fp32, fp8_hybrid (E4M3 forward, E5M2 gradients; fp8_scaling below) or nvfp4 (the
    NVFP4 pretraining recipe of arXiv 2509.25149, emulated on Hopper: docs/precision.md)."""
    master_dtype: FloatDtype = "fp32"
    """Dtype of the weights the optimizer updates."""
    gradient_dtype: FloatDtype | None = None
    """Dtype of the activation gradients (the backward pass), as Surogate's key: it is the recipe's matmul dtype,
    bf16 (fp32 with recipe: fp32), and may only be written as that; unset: the same. The weights' gradients are
    accumulated in fp32 whatever it is."""
    fp8_scaling: Fp8Scaling | None = None
    """fp8_hybrid scaling: delayed (per tensor, from the amax history of the previous steps), current (per tensor,
    its own amax this step) or blockwise (1x128 activation / gradient tiles, 128x128 weight blocks, emulated with
    bf16 GEMMs on Hopper). Unset: delayed (the fastest, Transformer Engine's default), or current where delayed
    does not run (offload_optimizer, pipeline stages)."""
    fp8_amax_history: int = Field(default=1024, gt=0)
    """fp8_scaling: delayed: length of the rolling amax history (Transformer Engine's amax_history_len)."""
    fp8_amax_compute_algo: AmaxAlgo = "max"
    """fp8_scaling: delayed: the amax a scale is taken from, the history's max or its most recent entry."""
    skip_quant_first_layers: int | None = Field(default=None, ge=0)
    """Keep this many first decoder layers in bf16 under fp8_hybrid / nvfp4. Unset: 0 (fp8_hybrid); nvfp4 keeps
    ceil(15 %) of the layers in bf16, a fifth of them first (surojax.precision.nvfp4_transform.bf16_layers)."""
    skip_quant_last_layers: int | None = Field(default=None, ge=0)
