"""Mixture-of-experts training keys: the router losses and an optional expert capacity.

They apply to a MoE model only (qwen3_moe, mixtral, gpt_oss): on a dense model a key set away from its default
is refused when the model is known (train/run_spec.py). `train_router` (train the router alongside a LoRA
adapter) sits with the LoRA keys (config/lora.py).
"""
from __future__ import annotations

from pydantic import Field

from surojax.config.base import StrictModel


class MoESection(StrictModel):
    router_aux_loss_coef: float | None = Field(default=None, ge=0.0)
    """Weight of the load-balancing loss (Switch / Qwen form) in the training loss. Default: the model's
    config.json `router_aux_loss_coef` when the router trains (`train_router`, or a full fine-tune) or config.json
    has `output_router_logits: true` (transformers' switch), else 0 (a LoRA run's loss is then transformers').
    Logged either way. 0 turns it off."""
    router_z_loss_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the router z-loss (ST-MoE: mean logsumexp(router logits)^2); 0 (default) turns it off."""
    capacity_factor: float | None = Field(default=None, gt=0.0)
    """Cap each expert at ceil(factor x assignments / experts) per layer call; the assignments past the cap are
    dropped (counted in the metrics). Default: none, dropless routing."""
