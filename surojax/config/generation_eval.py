"""Generation-eval keys: greedy answers on held-out prompts, scored by exact match, before and after training.

    eval_generation:
      path: configs/quickstart/test.jsonl    # instruction or conversation rows (the expected answer included)
      samples: 200                           # only the first 200 rows (default: all)
      max_new_tokens: 32
      show: 4                                # sample generations printed (and saved) per evaluation
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from surojax.config.base import StrictModel
from surojax.config.data import DatasetSpec


class GenerationEvalSpec(DatasetSpec):
    """A dataset entry (path, type, samples, *_field ...) plus how to generate and report."""

    max_new_tokens: int = Field(default=64, gt=0)
    """Tokens generated per prompt at most (greedy; a row stops at the tokenizer's EOS)."""
    show: int = Field(default=3, ge=0)
    """How many (prompt, expected, got) samples to print and save."""
    batch_size: int = Field(default=256, gt=0)
    """Prompts generated together."""

    @field_validator("type")
    @classmethod
    def _answer_types(cls, v: str) -> str:
        if v not in ("instruction", "conversation", "auto"):
            raise ValueError(f"{v!r} has no expected answer to score; use instruction, conversation or auto")
        return v


class GenerationEvalSection(StrictModel):
    eval_generation: GenerationEvalSpec | None = None
    """Held-out prompts to answer greedily before and after training; exact-match accuracy (the last number
    when the expected answer has one) and samples go to the console and `<output_dir>/generation_eval.json`."""

    @field_validator("eval_generation", mode="before")
    @classmethod
    def _path_alone(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v
