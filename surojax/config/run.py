"""Run keys: which model, where outputs go, how long to train, when to save, evaluate and log."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from surojax.config.base import StrictModel

ReportSink = Literal["tensorboard", "wandb", "aim", "jsonl"]
# rope_scaling given as a type name (Surogate's spelling): the factor comes from max_model_len (train/run_spec.py)
RopeScalingType = Literal["linear", "yarn"]


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
    model_type: str | None = None
    """The model family the config expects (config.json's model_type, e.g. qwen3, or a family prefix such as qwen
    for qwen2 / qwen3 / qwen3_moe): checked against the model before training; unset: whatever `model` is."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Longest sequence the model is built for (rope tables); defaults to the model's own."""
    rope_scaling: dict[str, Any] | RopeScalingType | None = None
    """HF-style rope_scaling dict that replaces the model's (e.g. {rope_type: yarn, factor: 4.0}; JSON text is read
    as the dict), or a type name, linear or yarn, with max_model_len: the factor is then
    ceil(max_model_len / the model's original context), as Surogate computes it."""
    seed: int = 42
    """Seeds the data order (shuffle, validation split), LoRA initialisation and dropout."""
    use_cuda_graphs: bool | None = None
    """GPU: whether XLA may capture the step's kernels as CUDA graphs (command buffers; XLA's default: yes).
    false sets XLA_FLAGS --xla_gpu_enable_command_buffer= before JAX starts its GPU backend (surojax/train/
    xla_options.py); unset or true keeps XLA's default. CPU runs have no CUDA graphs."""

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
    """Metric sinks besides the console: tensorboard, wandb, aim, jsonl. `none` or [] for console only."""
    run_name: str | None = None
    """The run's name: printed at start, and its name in wandb and aim unless wandb_name / aim_name say otherwise."""
    wandb_project: str | None = None
    wandb_name: str | None = None
    """report_to: wandb — the run's name there (default: run_name, else wandb's)."""
    aim_experiment: str | None = None
    """report_to: aim — the Aim experiment the run joins (default: Aim's)."""
    aim_repo: str | None = None
    """report_to: aim — the Aim repository (a path or aim:// URL; default: Aim's, .aim in the working directory)."""
    aim_name: str | None = None
    """report_to: aim — the run's name there (default: run_name)."""

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

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _json_rope_scaling(cls, v: Any) -> Any:
        if isinstance(v, str) and v.lstrip().startswith("{"):
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"is JSON text that does not parse: {e}") from None
        if v == "dynamic":
            raise ValueError("dynamic (NTK) rope scaling is not available; linear, yarn, or a dict with rope_type "
                             "linear / llama3 / yarn")
        return v

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v: Any) -> Any:
        if v is None or v == "none":
            return []
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v
