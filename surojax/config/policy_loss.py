"""`beta` and `loss_type`: one pair of keys that DPO and GRPO both read (TRL names them the same in both trainers).

Their meaning and default depend on the trainer, so the config holds them unset (None) and these functions give the
value a trainer uses; set on any other trainer they are refused (config/rules.py).

    trainer   beta                                          loss_type
    dpo       0.1, > 0: rewards are beta x log-ratio        sigmoid (default) | ipo | hinge
    grpo      0.0: KL weight to the reference (0: none)     dapo (default) | grpo | dr_grpo | gspo
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from surojax.config.base import StrictModel

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "gspo")
DEFAULTS = {"dpo": (0.1, "sigmoid"), "grpo": (0.0, "dapo")}  # trainer -> (beta, loss_type)
LOSS_TYPES = {"dpo": DPO_LOSS_TYPES, "grpo": GRPO_LOSS_TYPES}


class PolicyLossSection(StrictModel):
    beta: float | None = Field(default=None, ge=0.0)
    """trainer: dpo — how far the policy may move from the reference (rewards are beta x log-ratio; default 0.1,
    must be > 0). trainer: grpo — weight of the KL to the reference (k3 estimator; default 0.0: no reference pass)."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "dapo", "grpo", "dr_grpo", "gspo"] | None = None
    """trainer: dpo — sigmoid (DPO; default), ipo (squared loss on the mean-token log-ratio, target 1 / (2 beta))
    or hinge (SLiC). trainer: grpo — dapo (default), grpo, dr_grpo or gspo (TRL's normalisations)."""


def resolved_beta(cfg) -> float:
    """The beta the config's trainer uses (its default when unset)."""
    return DEFAULTS[cfg.trainer][0] if cfg.beta is None else cfg.beta


def resolved_loss_type(cfg) -> str:
    """The loss_type the config's trainer uses (its default when unset)."""
    return DEFAULTS[cfg.trainer][1] if cfg.loss_type is None else cfg.loss_type
