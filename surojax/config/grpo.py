"""GRPO keys (`trainer: grpo`): the rollouts (group size, sampling), the policy loss and the rewards.

Names and defaults follow TRL's GRPOConfig. Every key here applies to `trainer: grpo` only; set away from its
default under another trainer it is refused (config/rules.py).

    trainer: grpo
    num_generations: 8                 # completions sampled per prompt (one group)
    max_completion_length: 256
    loss_type: dapo                    # grpo | dr_grpo | dapo | gspo
    beta: 0.0                          # KL to the reference (k3); 0: no reference pass
    reward_functions: [exact_match, my_rewards:length_penalty]
    reward_weights: [1.0, 0.1]
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from surojax.config.base import StrictModel

ScaleRewards = Literal["group", "batch", "none"]
BUILTIN_REWARDS = ("exact_match", "format_regex")


class GRPOSection(StrictModel):
    num_generations: int = Field(default=8, ge=2)
    """Completions sampled per prompt: the group whose mean reward is each completion's baseline (at least 2)."""
    max_completion_length: int = Field(default=256, gt=0)
    """Tokens generated per completion at most; also dr_grpo's normalising constant."""
    temperature: float = Field(default=1.0, gt=0.0)
    """trainer: grpo — the rollouts' sampling temperature; the loss's log-probabilities use the same one (TRL).
    trainer: distill — softens the teacher's top-K and the student's softmax by T; the KL is scaled by T^2."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling of the rollouts (1.0: the whole distribution)."""
    # `beta` (KL weight, default 0.0: no reference pass) and `loss_type` (dapo | grpo | dr_grpo | gspo, default
    # dapo: TRL's normalisations) are shared with DPO: config/policy_loss.py.
    epsilon: float = Field(default=0.2, gt=0.0)
    """Clipping: the importance ratio is clipped below at 1 - epsilon."""
    epsilon_high: float | None = Field(default=None, gt=0.0)
    """Clipping above at 1 + epsilon_high (DAPO's clip-higher, 0.28 in the paper); default: epsilon."""
    num_iterations: int = Field(default=1, ge=1)
    """Optimizer updates per generation batch (TRL's mu): >1 reuses the rollouts, clipped against their old
    log-probabilities."""
    scale_rewards: ScaleRewards = "group"
    """Divide the advantages by the group's reward std (`group`), the whole batch's (`batch`), or not (`none`)."""
    reward_functions: list[str] = Field(default_factory=list)
    """Reward functions: built-ins (`exact_match`, `format_regex`) or `module:function` importable from the working
    directory or PYTHONPATH, with TRL's signature f(prompts, completions, **columns) -> list[float | None]."""
    reward_weights: list[float] | None = None
    """One weight per reward function (default: all 1.0); the reward is the weighted sum."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length (no EOS) out of the loss (DAPO)."""
    exact_match_column: str = "answer"
    """The data column the `exact_match` reward compares each completion with."""
    format_regex: str | None = None
    """The pattern the `format_regex` reward checks (re.search over the completion; 1.0 on a match, else 0.0)."""

    @field_validator("reward_functions", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("reward_functions")
    @classmethod
    def _spelled(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in BUILTIN_REWARDS and (name.count(":") != 1 or not all(name.split(":"))):
                raise ValueError(f"{name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor "
                                 "`module:function`")
        return v

    @field_validator("format_regex")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        return v

    @property
    def clip_high(self) -> float:
        """epsilon_high, defaulting to epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
