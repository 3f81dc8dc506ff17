"""TrainConfig: the whole training YAML, flat like Surogate's, assembled from one section per concept.

Keys are the YAML keys users already write (Surogate / Axolotl). The one renamed attribute is
`model_config_overrides` for the YAML key `model_config` (pydantic reserves that name).
Single-field checks live on the fields (section files); cross-field checks in rules.py, run here once.
"""
from __future__ import annotations

from pydantic import PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from surojax.config.data import DataSection
from surojax.config.distill import DistillSection
from surojax.config.dpo import DPOSection
from surojax.config.generation_eval import GenerationEvalSection
from surojax.config.grpo import GRPOSection
from surojax.config.lora import LoraSection, QLoraSection
from surojax.config.memory import MemorySection
from surojax.config.moe import MoESection
from surojax.config.optim import OptimSection
from surojax.config.policy_loss import PolicyLossSection
from surojax.config.precision import PrecisionSection
from surojax.config.rules import cross_field_problems
from surojax.config.run import RunSection
from surojax.config.zero import ZeroSection


# Bases in reverse: pydantic orders fields from the last base to the first, so dumps and errors read run first.
class TrainConfig(
    PolicyLossSection, DPOSection, GRPOSection, DistillSection,
    GenerationEvalSection, ZeroSection, MemorySection, OptimSection, MoESection, QLoraSection, LoraSection,
    PrecisionSection, DataSection, RunSection,
):
    """A validated training config. Build it with `load_config(path)` or `config_from_dict(d)`."""

    # Set by the loader (config/surogate.py): the Surogate spellings the config wrote (none: not a Surogate config)
    # and readings worth a start-up line. Private: not keys, not dumped; kept by model_copy.
    _surogate_spellings: tuple[str, ...] = PrivateAttr(default=())
    _surogate_notes: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _cross_fields(self) -> TrainConfig:
        problems = cross_field_problems(self)
        if problems:
            # One pydantic error carrying all problems; explain.py expands it into one problem per rule.
            raise PydanticCustomError("cross_field", "{count} cross-field problem(s)",
                                      {"count": len(problems), "problems": problems})
        return self

    @property
    def resolved_fp8_scaling(self) -> str:
        """fp8_hybrid's scaling for this run: `fp8_scaling`, or unset delayed, except current with offload_optimizer
        (its in-place update bypasses the step that rolls the amax histories) and pipeline stages (a layer runs once
        per microbatch: its amaxes would add up)."""
        if self.fp8_scaling is not None:
            return self.fp8_scaling
        return "current" if self.offload_optimizer or self.parallel.stage > 1 else "delayed"

    @property
    def is_qlora(self) -> bool:
        return self.lora and self.qlora is not None

    def warmup_steps_for(self, total_steps: int) -> int:
        """Warmup steps for a run of `total_steps`: `warmup_steps`, or (unset or 0) `warmup_ratio` of the steps, or
        0."""
        if self.warmup_steps:
            return min(self.warmup_steps, total_steps)
        if self.warmup_ratio is not None:
            return round(self.warmup_ratio * total_steps)
        return 0
