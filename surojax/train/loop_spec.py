"""What the training loop reads, made once from a TrainConfig: `loop_spec(cfg)` -> LoopSpec.

    LoopSpec
      trainer      the trainer kind (sft, pt, dpo, grpo, distill)
      kind         what trains: "LoRA", "pretraining" or "full fine-tune" (the summary's words)
      seed         data order and dropout keys
      length       RunLength: max_steps, or epochs (epoch_adjustment: the Chinchilla budget sets them)
      batch        BatchSpec: rows per device per micro-batch, accumulation, sequence length
      cadence      Cadence: when to log, evaluate and checkpoint
      output       OutputSpec: output_dir, the checkpoint folder and how many to keep, the export's base name
      resume       resume_from_checkpoint: False, True (the latest) or a step folder
      metrics      MetricsSpec: the sinks and the run names they get
      stop_on_nonfinite_loss  a non-finite loss ends the run (unless auto_lr_reduction skips such steps)

`run_spec` (train/run_spec.py) describes the model and its step; this spec the loop around it. The Trainer reads
the config while it is built (these two specs, the data pipeline, the mesh, the checkpoint record) and these specs
after, so a loop setting has one reading: here.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from surojax.config.schema import TrainConfig
from surojax.train.run_spec import BatchSpec


@dataclasses.dataclass(frozen=True)
class RunLength:
    max_steps: int | None  # None: the epochs below
    num_epochs: float
    epoch_adjustment: bool  # the Chinchilla budget (20 tokens per parameter) sets the epochs

    @property
    def loader_epochs(self) -> int | None:
        """The epochs the data loader repeats its rows for (None: without end; max_steps or the budget stops)."""
        return None if (self.max_steps or self.epoch_adjustment) else max(1, math.ceil(self.num_epochs))


@dataclasses.dataclass(frozen=True)
class Cadence:
    logging_steps: int = 1
    eval_steps: int | None = None
    save_steps: int | None = None

    def logs(self, step: int, total: int) -> bool:
        """The metrics row (and the plain progress line) of `step`: every logging_steps, the first and the last."""
        return step % self.logging_steps == 0 or step in (1, total)

    def evaluates(self, step: int) -> bool:
        return bool(self.eval_steps) and step % self.eval_steps == 0

    def saves(self, step: int) -> bool:
        return bool(self.save_steps) and step % self.save_steps == 0


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    output_dir: Path
    checkpoint_dir: Path  # checkpoint_dir, default <output_dir>/checkpoints
    save_total_limit: int | None = None
    base_model: str | None = None  # what an exported adapter names as its base (the `model` key)


@dataclasses.dataclass(frozen=True)
class MetricsSpec:
    report_to: tuple[str, ...] = ("jsonl",)
    project: str = "surojax"
    run_name: str | None = None
    wandb_name: str | None = None
    aim_experiment: str | None = None
    aim_repo: str | None = None
    aim_name: str | None = None


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    trainer: str
    kind: str
    seed: int
    length: RunLength
    batch: BatchSpec
    cadence: Cadence
    output: OutputSpec
    metrics: MetricsSpec
    resume: bool | str = False
    stop_on_nonfinite_loss: bool = True

    @property
    def resuming(self) -> bool:
        return bool(self.resume)


def loop_spec(cfg: TrainConfig) -> LoopSpec:
    out = Path(cfg.output_dir)
    kind = "LoRA" if cfg.lora else ("pretraining" if cfg.from_scratch else "full fine-tune")
    return LoopSpec(
        trainer=cfg.trainer, kind=kind, seed=cfg.seed,
        length=RunLength(cfg.max_steps, cfg.num_epochs, cfg.epoch_adjustment),
        batch=BatchSpec(rows=cfg.per_device_train_batch_size, accumulation=cfg.gradient_accumulation_steps,
                        sequence_len=cfg.sequence_len),
        cadence=Cadence(cfg.logging_steps, cfg.eval_steps, cfg.save_steps),
        output=OutputSpec(out, Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else out / "checkpoints",
                          cfg.save_total_limit, cfg.model),
        metrics=MetricsSpec(tuple(cfg.report_to), cfg.wandb_project or "surojax", cfg.run_name, cfg.wandb_name,
                            cfg.aim_experiment, cfg.aim_repo, cfg.aim_name),
        resume=cfg.resume_from_checkpoint or False, stop_on_nonfinite_loss=not cfg.auto_lr_reduction)


__all__ = ["Cadence", "LoopSpec", "MetricsSpec", "OutputSpec", "RunLength", "loop_spec"]
