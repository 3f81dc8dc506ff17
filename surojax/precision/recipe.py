"""`Recipe`: the precision recipe of a run (config key `recipe`), typed once by surojax.train.run_spec.

    FP32        everything fp32 (exact CPU tests)
    BF16        bf16 compute (matmul operands), fp32 accumulation
    FP8_HYBRID  bf16, and the decoder's Linear layers multiply in FP8 (the FP8 transform: fp8_recipe.py)
    NVFP4       bf16, and the decoder's Linear layers run the NVFP4 recipe (nvfp4_transform.py)

What a recipe does to the model is its transform's; code elsewhere asks the two properties below, never the name.
"""
from __future__ import annotations

import enum

import jax.numpy as jnp


class Recipe(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP8_HYBRID = "fp8_hybrid"
    NVFP4 = "nvfp4"

    @property
    def compute_dtype(self):
        """The activation / matmul-operand dtype (also the teacher's and the exported weights')."""
        return jnp.float32 if self is Recipe.FP32 else jnp.bfloat16

    @property
    def quantizes_linears(self) -> bool:
        """Whether a transform swaps the decoder's Linear layers (FP8, NVFP4): it needs a bf16 base built on the
        device, not a quantised or host-built one."""
        return self in (Recipe.FP8_HYBRID, Recipe.NVFP4)


RECIPES = tuple(r.value for r in Recipe)

__all__ = ["RECIPES", "Recipe"]
