"""Run keys: which model, where outputs go, how long to train, when to save, evaluate and log."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from surojax.config.base import StrictModel

ReportSink = Literal["tensorboard", "wandb", "jsonl"]


class RunSection(StrictModel):
    trainer: Literal["sft", "dpo", "grpo", "distill"] = "sft"
    """What the run trains: `sft` (supervised fine-tuning and pretraining on text / instruction / conversation
    data), `distill` (knowledge distillation from a `teacher`). `surojax sft` / `pt` / `python -m surojax.train`
    read it; post-training trainers add their names here."""
    model: str | None = None
    """Base model: a local directory (HF safetensors + config.json), a .gguf file, or a Hugging Face Hub id
    (org/name[@revision], org/name:QUANT; fetched by surojax.hub). Required unless `from_scratch` with
    `model_config`."""
    tokenizer: str | None = None
    """Tokenizer directory or repo id; defaults to `model`."""
    output_dir: str = "output"
    """Where the final model / adapter, metrics and (by default) checkpoints are written."""
    from_scratch: bool = False
    """Initialise weights randomly (pretraining) instead of loading them."""
    model_config_overrides: dict[str, Any] | None = Field(default=None, alias="model_config")
    """HF config.json keys for `from_scratch`; applied over `model`'s config.json when `model` is also given."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Longest sequence the model is built for (rope tables); defaults to the model's own."""
    rope_scaling: dict[str, Any] | None = None
    """HF-style rope_scaling dict that replaces the model's (e.g. {rope_type: yarn, factor: 4.0})."""
    seed: int = 42

    num_epochs: float | None = Field(default=1.0, gt=0)
    """Passes over the training data; ignored when `max_steps` is set."""
    max_steps: int | None = Field(default=None, gt=0)
    """Optimizer steps to run; takes precedence over `num_epochs`. -1 means unset."""

    save_steps: int | None = Field(default=None, gt=0)
    """Checkpoint every this many steps; unset: only the final save."""
    save_total_limit: int | None = Field(default=None, gt=0)
    """Keep at most this many checkpoints (oldest deleted first)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; defaults to `<output_dir>/checkpoints`."""
    resume_from_checkpoint: bool | str | None = None
    """true: resume from the latest checkpoint in `checkpoint_dir`; a path: resume from that checkpoint."""

    eval_steps: int | None = Field(default=None, gt=0)
    """Evaluate on the validation data every this many steps (needs validation data)."""
    logging_steps: int = Field(default=1, gt=0)
    report_to: list[ReportSink] = Field(default_factory=lambda: ["jsonl"])
    """Metric sinks besides the console: tensorboard, wandb, jsonl. `none` or [] for console only."""
    wandb_project: str | None = None

    @field_validator("max_steps", mode="before")
    @classmethod
    def _minus_one_is_unset(cls, v: Any) -> Any:
        return None if v == -1 else v

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _bool_or_path(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (bool, str)):
            raise ValueError(f"must be true, false or a checkpoint path (got {v!r})")
        return v

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v: Any) -> Any:
        if v is None or v == "none":
            return []
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v
