"""Precision keys: the compute recipe and the dtypes of gradients and master weights."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from surojax.config.base import StrictModel

Recipe = Literal["bf16", "fp32", "fp8_hybrid", "nvfp4"]
FloatDtype = Literal["fp32", "bf16"]


class PrecisionSection(StrictModel):
    recipe: Recipe = "bf16"
    """Matmul precision: bf16, fp32, fp8_hybrid (E4M3 forward, E5M2 gradients, delayed scaling) or nvfp4 (the
    NVFP4 pretraining recipe of arXiv 2509.25149, emulated on Hopper: docs/precision.md)."""
    master_dtype: FloatDtype = "fp32"
    """Dtype of the weights the optimizer updates."""
    gradient_dtype: FloatDtype | None = None
    """Dtype gradients are accumulated in; unset: the recipe's choice (fp32)."""
    fp8_amax_history: int = Field(default=1024, gt=0)
    """Length of the rolling amax history for fp8_hybrid delayed scaling."""
    skip_quant_first_layers: int | None = Field(default=None, ge=0)
    """Keep this many first decoder layers in bf16 under fp8_hybrid / nvfp4. Unset: 0 (fp8_hybrid); nvfp4 keeps
    ceil(15 %) of the layers in bf16, a fifth of them first (surojax.precision.nvfp4_transform.bf16_layers)."""
    skip_quant_last_layers: int | None = Field(default=None, ge=0)
    """Keep this many last decoder layers in bf16 (unset: as skip_quant_first_layers says)."""
