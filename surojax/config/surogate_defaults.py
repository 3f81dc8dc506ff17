"""Surogate's documented defaults where surojax's differ, and the start-up lines that list them.

surojax keeps its own defaults (docs/surogate_compat.md gives each decision and its reason): changing one would
change every existing run. A config that looks like Surogate's (it wrote one of Surogate's spellings: the loader
records them, config/surogate.py) prints at start each default below that it leaves unset and that matters for the
run (`DefaultDiff.applies`: lora_dropout only with LoRA, fp8_amax_history only under delayed fp8 scaling, ...),
next to Surogate's documented value.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from surojax.config.schema import TrainConfig


@dataclasses.dataclass(frozen=True)
class DefaultDiff:
    """One Surogate default surojax does not share: the surojax key, Surogate's documented value, and when the
    difference reaches a run (`applies`)."""

    key: str
    surogate: str
    applies: Callable[[TrainConfig], bool] = lambda cfg: True


def _validating(cfg: TrainConfig) -> bool:
    return bool(cfg.validation_datasets) or cfg.validation_split_ratio > 0


DEFAULTS: tuple[DefaultDiff, ...] = (
    DefaultDiff("lora", "true (LoRA)", lambda c: not c.lora and not c.from_scratch),
    DefaultDiff("optimizer", "adamw_8bit"),
    DefaultDiff("lr_scheduler_type", "linear"),
    DefaultDiff("weight_decay", "0.1"),
    DefaultDiff("lora_dropout", "0.05", lambda c: c.lora),
    DefaultDiff("validation_split_ratio", "0.1", lambda c: not c.validation_datasets),
    DefaultDiff("eval_steps", "100", _validating),
    DefaultDiff("num_epochs", "3", lambda c: c.max_steps is None and not c.epoch_adjustment),
    DefaultDiff("sequence_len", "1024"),
    DefaultDiff("per_device_train_batch_size", "2"),
    DefaultDiff("gradient_accumulation_steps", "4"),
    DefaultDiff("seed", "1234 (train_seed)"),
    DefaultDiff("save_steps", "50"),
    DefaultDiff("save_total_limit", "5", lambda c: c.save_steps is not None),
    DefaultDiff("resume_from_checkpoint", "true"),
    DefaultDiff("checkpoint_dir", "output_dir itself"),
    DefaultDiff("zero_stage", "1 (zero_level)", lambda c: c.parallel.fsdp == 1),
    DefaultDiff("recompute", "true (full)"),
    DefaultDiff("master_dtype", "the model's dtype (bf16)", lambda c: not c.lora and c.recipe != "fp32"),
    DefaultDiff("fp8_amax_history", "16",
                lambda c: c.recipe == "fp8_hybrid" and c.resolved_fp8_scaling == "delayed"),
    DefaultDiff("skip_quant_first_layers", "0", lambda c: c.recipe == "nvfp4"),
    DefaultDiff("skip_quant_last_layers", "0", lambda c: c.recipe == "nvfp4"),
    DefaultDiff("qlora_four_over_six", "true", lambda c: c.lora and c.qlora == "nvfp4"),
    DefaultDiff("truncation_strategy", "delete", lambda c: c.trainer in ("sft", "distill")),
    DefaultDiff("dataloader_num_workers", "min(CPU count, 8)"),
    DefaultDiff("teacher_top_k", "32 (distillation.top_k)", lambda c: c.trainer == "distill"),
    DefaultDiff("report_to", "none (its own metrics file)"),
)
_SUROJAX_SHOWN = {"zero_stage": lambda c: c.resolved_zero_stage, "dataloader_num_workers": lambda c: 2,
                  "checkpoint_dir": lambda c: f"{c.output_dir}/checkpoints", "qlora_four_over_six": lambda c: False,
                  "skip_quant_first_layers": lambda c: "ceil(15%) of the layers, a fifth first",
                  "skip_quant_last_layers": lambda c: "ceil(15%) of the layers, four fifths last",
                  "resume_from_checkpoint": lambda c: False}


def differing_defaults(cfg: TrainConfig) -> list[tuple[str, str, str]]:
    """(key, surojax's value, Surogate's documented default) for each default of DEFAULTS that this run uses
    (the config leaves the key unset) and that matters here."""
    out, written = [], cfg.model_fields_set | set(cfg._surogate_spellings)
    for d in DEFAULTS:
        if d.key in written or not d.applies(cfg):
            continue
        shown = _SUROJAX_SHOWN.get(d.key)
        value = shown(cfg) if shown else getattr(cfg, d.key)
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "none"
        value = "unset" if value is None else value
        out.append((d.key, str(value).lower() if isinstance(value, bool) else str(value), d.surogate))
    return out


def summary_lines(cfg: TrainConfig) -> list[str]:
    """The start-up lines of a config that looks like Surogate's (none otherwise): which spellings were read, the
    notes, and every default that differs from Surogate's."""
    spellings = cfg._surogate_spellings
    if not spellings:
        return []
    shown = ", ".join(spellings[:6]) + (f" and {len(spellings) - 6} more" if len(spellings) > 6 else "")
    lines = [f"surogate  read Surogate's spellings ({shown})", *(f"surogate  {n}" for n in cfg._surogate_notes)]
    diffs = differing_defaults(cfg)
    if diffs:
        lines.append("surogate  defaults that differ from Surogate's (unset in this config; docs/surogate_compat.md):")
        width = max(len(k) for k, _, _ in diffs)
        lines += [f"surogate    {k:<{width}}  {ours}  (Surogate: {theirs})" for k, ours, theirs in diffs]
    return lines
