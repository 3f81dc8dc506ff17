"""Data keys: the datasets (a list of small specs), validation data, sequence length, packing, chat template."""
from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, field_validator

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
    input_field: str | None = "input"
    """Instruction rows' input column (null: none)."""
    output_field: str = "output"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    """The prompt column of `type: prompt` rows (GRPO) and of preference rows (DPO)."""
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_prompt: str | None = None
    """System message prepended to instruction / conversation rows that have none."""
    system_field: str | None = None
    """The column holding each row's system prompt (instruction and conversation rows); a row whose value is empty
    or missing falls back to `system_prompt`. Surogate's `system_prompt_type: field` + `system_prompt_field`."""
    tools_field: str | None = "tools"
    """The column holding a conversation's tool definitions (a list, or JSON text), passed to the chat template
    (null: none)."""
    message_property_mappings: dict[str, str] | None = None
    """Message keys under other names, surojax key -> the dataset's: e.g. {role: speaker, content: text}
    (role, content, tool_calls)."""
    prompt_format: str | None = None
    """Instruction rows: the user turn as a Python format string of {instruction} and {input} (default: the
    instruction, a blank line, the input). Without a chat template it is the whole prompt before the output."""
    prompt_format_no_input: str | None = None
    """prompt_format for rows whose input is empty: {instruction} only (default: the instruction)."""

    @field_validator("prompt_format", "prompt_format_no_input")
    @classmethod
    def _placeholders(cls, v: str | None, info) -> str | None:
        if v is None:
            return v
        allowed = {"instruction", "input"} if info.field_name == "prompt_format" else {"instruction"}
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
        except ValueError as e:
            raise ValueError(f"not a valid format string: {e}") from None
        bad = sorted(names - allowed)
        if bad:
            raise ValueError(f"placeholder {{{bad[0]}}} is not available: the format writes the user turn from "
                             f"{', '.join('{' + a + '}' for a in sorted(allowed))}; the system prompt goes in "
                             "system_prompt / system_field and the output is the assistant turn")
        return v

    @field_validator("message_property_mappings")
    @classmethod
    def _message_keys(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        bad = sorted(set(v or {}) - set(MESSAGE_PROPERTIES))
        if bad:
            raise ValueError(f"{bad[0]!r} is not a message property; map {', '.join(MESSAGE_PROPERTIES)}")
        return v


MESSAGE_PROPERTIES = ("role", "content", "tool_calls")
# Chat template families `template:` may name (Surogate's names), each with a marker its template text holds.
TEMPLATE_FAMILIES: dict[str, str] = {
    **dict.fromkeys(("chatml", "qwen", "qwen2", "qwen2_5", "qwen3", "qwen3_moe", "qwen3_5"), "<|im_start|>"),
    **dict.fromkeys(("llama3", "llama3_1", "llama3_2", "llama3_3"), "<|start_header_id|>"),
    **dict.fromkeys(("llama", "llama2", "mistral"), "[INST]"),
    "gemma": "<start_of_turn>", "gpt_oss": "<|channel|>",
}
TruncationStrategy = Literal["right", "left", "delete", "split"]


class DataSection(StrictModel):
    datasets: list[DatasetSpec] = Field(min_length=1)
    """Dataset entries; a path alone may stand for its entry (`datasets: org/name` or `[a.jsonl, org/name]`)."""
    validation_datasets: list[DatasetSpec] = Field(default_factory=list)

    @field_validator("datasets", "validation_datasets", mode="before")
    @classmethod
    def _paths_as_entries(cls, value):
        """`datasets: mlabonne/FineTome-100k` is `datasets: [{path: mlabonne/FineTome-100k}]`; so is a string in
        the list. Anything else is validated as written."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [{"path": v} if isinstance(v, str) else v for v in value]
        return value
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
    template: str | None = None
    """A chat template family by name (Surogate's names: chatml, qwen, qwen2_5, qwen3, llama, llama3, llama3_2,
    mistral, gemma, gpt_oss): the tokenizer's own template is used and must be of that family (checked when the
    data is built). Another template: give its text or file as chat_template."""
    use_chat_template: bool = True
    """Render instruction rows with the chat template (when the tokenizer has one). false: the plain prompt
    (prompt_format, or the alpaca layout) followed by the output; conversation rows need a template and are
    refused."""
    truncation_strategy: TruncationStrategy = "right"
    """An example longer than max_length: right (keep its first tokens), left (keep its last tokens), delete
    (drop it, counted) or split (into several examples of max_length; pieces with nothing supervised dropped)."""
    max_length: int | None = Field(default=None, gt=0)
    """Longest example (tokens) before truncation_strategy applies; default and at most sequence_len."""
    max_pixels: int | None = Field(default=None, gt=0)
    """Vision-language models: the most pixels an image is resized to (Surogate's key; the image processor's
    max_pixels), overriding the model folder's preprocessor_config.json. Fewer pixels, fewer image tokens."""
    dataloader_num_workers: int | None = Field(default=None, ge=0)
    """Threads that read and batch the packed rows ahead of the training step (grain's read threads); 0 reads
    them in the training loop's thread. Default 2. Tokenizing happens once, up front, in the main process."""

    @field_validator("template")
    @classmethod
    def _family(cls, v: str | None) -> str | None:
        if v == "auto":  # Surogate's default: the model's own template
            return None
        if v is not None and v not in TEMPLATE_FAMILIES:
            raise ValueError(f"{v!r} is not a template family surojax knows ({', '.join(TEMPLATE_FAMILIES)}); "
                             "give the template's text or .jinja file as chat_template instead")
        return v
