"""Data keys: the datasets (a list of small specs), validation data, sequence length, packing, chat template."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from surojax.config.base import StrictModel

DatasetType = Literal["text", "instruction", "conversation", "preference", "prompt", "auto"]


class DatasetSpec(StrictModel):
    """One dataset entry of `datasets:` / `validation_datasets:`."""

    path: str = Field(min_length=1)
    """A local .jsonl / .json / .parquet / .csv / .arrow file or directory, or a Hugging Face Hub dataset id
    (org/name[@revision], loaded through `datasets.load_dataset` into its cache; surojax.hub)."""
    type: DatasetType = "auto"
    """text (pretraining), instruction, conversation (chat messages), preference (DPO pairs), prompt (GRPO: a
    prompt string or messages, other columns for the rewards; never detected by auto), or auto (detect from the
    columns)."""
    split: str = "train"
    subset: str | None = None
    """HF dataset configuration name (a Hub dataset's `name`; a local folder's subfolder)."""
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """Which files make the dataset, as datasets.load_dataset takes them: patterns relative to the Hub repo or
    the local folder; a string or list is the `train` split, a mapping gives each split its own."""
    samples: int | None = Field(default=None, gt=0)
    """Use only the first this many rows."""
    text_field: str = "text"
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    """The prompt column of `type: prompt` rows (GRPO) and of preference rows (DPO)."""
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_prompt: str | None = None
    """System message prepended to instruction / conversation rows that have none."""


class DataSection(StrictModel):
    datasets: list[DatasetSpec] = Field(min_length=1)
    validation_datasets: list[DatasetSpec] = Field(default_factory=list)
    validation_split_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Hold out this fraction of the training rows for validation (instead of `validation_datasets`)."""
    sequence_len: int = Field(default=2048, gt=0)
    """Tokens per packed row (or the truncation length without packing)."""
    sample_packing: bool = True
    """Pack several samples into each row (attention never crosses sample boundaries)."""
    train_on_inputs: bool = False
    """Also compute the loss on prompt / user tokens, not only on completions."""
    skip_invalid_rows: bool = False
    """Skip (and count) rows that do not parse or are empty, instead of failing."""
    chat_template: str | None = None
    """Jinja chat template: a file path or the template text; defaults to the tokenizer's."""
