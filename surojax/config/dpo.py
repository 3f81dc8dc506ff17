"""DPO keys (trainer: dpo; TRL's names): the preference loss and where its reference comes from.

They apply to `trainer: dpo` only: set on another trainer they are refused (config/rules.py). The reference is
the base without the adapter for LoRA / QLoRA, and log-probs precomputed in one pass over the data before
training for full fine-tuning (surojax/train/dpo.py).
"""
from __future__ import annotations

from pydantic import Field

from surojax.config.base import StrictModel


class DPOSection(StrictModel):
    # `beta` and `loss_type` (shared with GRPO) live in config/policy_loss.py: 0.1 and sigmoid for DPO.
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """cDPO: the probability that a pair's labels are flipped (loss_type sigmoid only)."""
    reference_free: bool = False
    """No reference model: the reference log-probs are 0 (the loss compares the policy's own log-probs)."""
