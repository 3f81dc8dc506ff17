"""`type: prompt` rows for GRPO: prompts to complete, with the columns the reward functions read.

A row holds `prompt` (the DatasetSpec's `prompt_field`) as a string (TRL's standard form: tokenized as it is, with
the tokenizer's special tokens, e.g. a BOS) or as chat messages (the conversational form: the chat template with
the generation prompt). Every other column is kept and handed to the reward functions by name (e.g. `answer` for
exact_match).

    prompts = load_prompts(specs, tokenizer, max_prompt_len=T - max_completion_length)
    order = PromptOrder(len(prompts), prompts_per_batch=P, seed=seed)
    rows = order.next()        # [P] row indices of the next generation batch

The order is a pure function of (seed, generation index): epoch e is the permutation
`default_rng([seed, e]).permutation(n)`, generation g takes positions g*P .. g*P+P-1 of the concatenated epochs.
Its whole state is the generation index, so a resumed run draws the same prompts as the uninterrupted one.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from surojax.config.data import DatasetSpec
from surojax.data.formats import _chat_template, _messages
from surojax.data.pipeline import (DataStats, DatasetEntry, dataset_spec, formatted_rows, row_has_images, row_video,
                                   spec_rows)
from surojax.data.sources import DataError, InvalidRowError, ReadStats
from surojax.data.tokenizer import Tokenizer
from surojax.wording import a_type

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids (what the engine prefills), the prompt as written in the data (a string or the
    messages: what reward functions receive as `prompts`), and the row's other columns."""

    ids: tuple[int, ...]
    prompt: str | list[dict]
    columns: Mapping[str, Any] = field(default_factory=dict)


def prompt_of_row(row: Mapping[str, Any], tokenizer: Tokenizer, spec: DatasetSpec, template: str | None) -> Prompt:
    """A `type: prompt` row -> Prompt. Raises InvalidRowError for a row without a usable prompt."""
    key = spec.prompt_field
    value = row.get(key)
    columns = {k: v for k, v in row.items() if k != key}
    if isinstance(value, str):
        if not value.strip():
            raise InvalidRowError(f"empty prompt in field {key!r}")
        return Prompt(tuple(tokenizer.encode(value, add_special_tokens=True)), value, columns)
    if isinstance(value, list):
        if template is None:
            raise InvalidRowError(f"field {key!r} holds chat messages but the tokenizer has no chat template "
                                  "(set chat_template)")
        messages = _messages({spec.messages_field: value}, spec)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)
        return Prompt(tuple(ids), messages, columns)
    found = "missing" if key not in row else a_type(value)
    raise InvalidRowError(f"prompt field {key!r} must be a string or a list of chat messages, found {found} "
                          f"(columns: {sorted(row)})")


def _text_row(row: Mapping[str, Any], spec: DatasetSpec) -> Mapping[str, Any]:
    """The row, refused by name when it has images (a named error, not a bad row that skip_invalid_rows drops)."""
    if row_has_images(row) or row_video(row):
        raise DataError(f"{spec.path}: a prompt row has images or a video; trainer: grpo generates from text prompts "
                        "only in this version (image rows train with trainer: sft)")
    return row


def load_prompts(datasets: Iterable[DatasetEntry], tokenizer: Tokenizer, *, max_prompt_len: int,
                 skip_invalid_rows: bool = False, chat_template: str | None = None,
                 stats: DataStats | None = None) -> list[Prompt]:
    """Every dataset's prompts, in order. A prompt longer than `max_prompt_len` tokens (sequence_len minus the
    completion budget) is dropped and counted in `stats.dropped_too_long` (cutting a prompt would change the task)."""
    out: list[Prompt] = []
    stats = stats if stats is not None else DataStats()
    stats.prompts = True
    for entry in datasets:
        spec = dataset_spec(entry)
        if spec.type != "prompt":
            raise DataError(f"{spec.path}: GRPO reads `type: prompt` datasets (a prompt column, other columns for "
                            f"the rewards), got type: {spec.type}")
        try:
            template = _chat_template(tokenizer, chat_template, required=True)
        except DataError:
            template = None  # string prompts need none; a messages row says so when it comes
        read = ReadStats()
        n0 = len(out)
        rows = spec_rows(spec, skip_invalid_rows=skip_invalid_rows, stats=read)
        for p in formatted_rows(rows, lambda row: prompt_of_row(_text_row(row, spec), tokenizer, spec, template),
                                skip_invalid_rows=skip_invalid_rows, read=read):
            if len(p.ids) > max_prompt_len:
                stats.dropped_too_long += 1
                continue
            out.append(p)
            stats.tokens += len(p.ids)
        stats.add_dataset(spec, "prompt", "set in the config", read, len(out) - n0)
    if stats.dropped_too_long:
        log.warning("dropped %d prompts longer than %d tokens (sequence_len - max_completion_length)",
                    stats.dropped_too_long, max_prompt_len)
    if not out:
        raise DataError(f"no prompts of at most {max_prompt_len} tokens in the datasets")
    stats.examples = len(out)
    return out


class PromptOrder:
    """Which prompts each generation batch takes (see the module docstring); checkpointable like TrainLoader.

    num_rows: training rows per epoch (prompts x `rows_per_prompt`, e.g. num_generations x num_iterations), the
    count the Trainer divides by its rows per step to plan the steps of `num_epochs`."""

    def __init__(self, num_prompts: int, prompts_per_batch: int, *, seed: int, num_epochs: int | None = None,
                 rows_per_prompt: int = 1):
        if num_prompts < 1 or prompts_per_batch < 1:
            raise ValueError(f"PromptOrder needs prompts ({num_prompts}) and prompts per batch ({prompts_per_batch})")
        self.num_prompts, self.prompts_per_batch, self.seed = num_prompts, prompts_per_batch, seed
        self.num_epochs = num_epochs
        self.num_rows = num_prompts * rows_per_prompt
        self.generation = 0  # the next generation batch's index

    def rows(self, generation: int) -> np.ndarray:
        """[P] prompt indices of generation batch `generation` (raises StopIteration past num_epochs)."""
        n, P = self.num_prompts, self.prompts_per_batch
        pos = np.arange(generation * P, (generation + 1) * P)
        epochs = pos // n
        if self.num_epochs is not None and epochs[-1] >= self.num_epochs:
            raise StopIteration
        perms = {int(e): np.random.default_rng([self.seed, int(e)]).permutation(n) for e in np.unique(epochs)}
        return np.array([perms[int(e)][i] for e, i in zip(epochs, pos % n)], np.int64)

    def next(self) -> np.ndarray:
        out = self.rows(self.generation)
        self.generation += 1
        return out

    def get_state(self) -> dict:
        return {"version": STATE_VERSION, "generation": self.generation, "prompts": self.num_prompts,
                "prompts_per_batch": self.prompts_per_batch, "seed": self.seed}

    def set_state(self, state: dict) -> None:
        saved = {k: state.get(k) for k in ("version", "prompts", "prompts_per_batch", "seed")}
        now = {"version": STATE_VERSION, "prompts": self.num_prompts, "prompts_per_batch": self.prompts_per_batch,
               "seed": self.seed}
        if saved != now:
            raise ValueError(f"cannot resume the prompt order: it was saved over {saved} but the data now gives "
                             f"{now} (the dataset, seed or batch size changed)")
        self.generation = int(state["generation"])

    def close(self) -> None:
        """Nothing to stop (no threads); the Trainer closes its data at the end."""


@dataclass(frozen=True)
class UnpackedRows:
    """The Trainer's view of row layout: one sequence per row plus its padding tail (cuDNN's packed bound)."""

    max_runs: int = 2


@dataclass
class PromptData:
    """What GRPOTrainer.build_data returns: the Trainer reads `train` (its state is checkpointed), `eval`, `stats`,
    `train_rows` / `eval_rows` (the row layout); the prompts themselves are in `prompts`."""

    prompts: list[Prompt]
    train: PromptOrder
    stats: DataStats
    eval: None = None
    train_rows: UnpackedRows = UnpackedRows()
    eval_rows: None = None
