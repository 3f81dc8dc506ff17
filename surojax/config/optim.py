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
    """Loss guard (surojax/train/loss_guard.py): a step with a NaN/inf loss or gradient norm is skipped; an anomaly
    (NaN/inf, a loss spike above mean + 3 sigma and 0.5 over the mean, a gradient norm above 10x its mean or
    above 100; statistics over the last 100 normal steps) halves the learning rate: the first one for 50 steps,
    blended back linearly, each later one for the rest of the run (at most 5 such cuts); one cut per 50 steps."""
    early_stop: bool = False
    """Stop training (surojax/train/early_stop.py) when the eval-loss convergence score stays above 0.85 for 5
    evals, when the loss reduction per FLOP falls under half its peak, or after 200 steps of divergence or 500
    steps of plateau (phases over a 100-step loss window)."""
    epoch_adjustment: bool = False
    """Set the number of epochs to reach the Chinchilla budget of 20 tokens per model parameter:
    ceil(20 N / dataset tokens), between 1 and 50."""
