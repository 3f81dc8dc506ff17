"""Optimisation keys: optimizer, learning-rate schedule, batch size, gradient clipping, adaptive training."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from surojax.config.base import StrictModel


class OptimSection(StrictModel):
    optimizer: Literal["adamw", "adamw_8bit", "normuon"] = "adamw"
    learning_rate: float = Field(default=2e-4, gt=0)
    lr_scheduler_type: Literal["constant", "linear", "cosine", "wsd"] = "cosine"
    """Decay after warmup: constant, linear or cosine to `final_lr_fraction`, or wsd (warmup-stable-decay, the
    decay over the last `cooldown_steps`)."""
    warmup_steps: int | None = Field(default=None, ge=0)
    """Linear warmup steps; or set `warmup_ratio` (not both). Neither: no warmup."""
    warmup_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    cooldown_steps: int | None = Field(default=None, ge=0)
    """wsd only: steps of the final linear decay to learning_rate * final_lr_fraction."""
    final_lr_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """The schedule ends at learning_rate * final_lr_fraction."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(default=1e-8, gt=0.0)
    max_grad_norm: float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    per_device_train_batch_size: int = Field(default=1, gt=0)
    """Rows (of `sequence_len` tokens) per data-parallel replica per micro-step."""
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    auto_lr_reduction: bool = False
    """Loss guard: halve the learning rate on loss spikes, exploding gradients and NaNs."""
    early_stop: bool = False
    """Stop on convergence, plateau or divergence (Surogate's rules)."""
    epoch_adjustment: bool = False
    """Set the number of epochs from the Chinchilla budget (20 tokens per parameter)."""
