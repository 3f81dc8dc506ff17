"""Preference (DPO) data: rows -> pairs of token sequences sharing a prompt -> rows of [2, T] arrays.

Row forms (TRL's names; the column names come from the dataset entry's prompt_field / chosen_field /
rejected_field):

    standard        {"prompt": str, "chosen": str, "rejected": str}
                    prompt ids = encode(prompt) with the tokenizer's own special tokens (BOS where its
                    post-processor adds one); response ids = encode(response) + EOS.
    conversational  {"prompt": [messages], "chosen": [assistant message(s)], "rejected": [...]}
                    prompt text = the chat template of the prompt with add_generation_prompt; response text =
                    the template of prompt + response minus that prefix (TRL's maybe_apply_chat_template);
                    each encoded without special tokens (the template writes them).

Each pair gives two sequences, prompt + chosen and prompt + rejected, supervised (loss_mask) on the response
tokens only. Truncation keeps the whole prompt and cuts each response to the `sequence_len - len(prompt)` tokens
that fit; a pair whose prompt leaves no room for a response token is dropped (counted in the stats). Sequences
are not packed: a row is one pair, arrays [2, T] (0 = chosen, 1 = rejected) per the batch contract
(surojax/data/batch.py), plus "pair" (its index, which the DPO trainer uses to look up precomputed reference
log-probs). `per_device_train_batch_size` therefore counts pairs, as in TRL.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from surojax.config.data import DatasetSpec
from surojax.data.batch import FIELDS, example_to_row
from surojax.data.formats import _chat_template, _messages, detect_type
from surojax.data.loader import TrainLoader, _local_batch, _process
from surojax.data.pipeline import (DataStats, DatasetEntry, chat_template_text, dataset_spec, formatted_rows,
                                   row_has_images, row_video, spec_rows, validation_split)
from surojax.data.sources import DataError, InvalidRowError, ReadStats
from surojax.data.tokenizer import ChatTemplateError, Tokenizer
from surojax.wording import a_type

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferencePair:
    """One tokenized pair: the shared prompt and the two responses (int32 ids, before truncation)."""

    prompt: np.ndarray    # [Lp]
    chosen: np.ndarray    # [Lc]
    rejected: np.ndarray  # [Lr]

    def fit(self, sequence_len: int) -> "PreferencePair | None":
        """The pair with each response cut to what fits after the whole prompt; None if no response token fits."""
        room = sequence_len - len(self.prompt)
        if room < 1:
            return None
        if len(self.chosen) <= room and len(self.rejected) <= room:
            return self
        return PreferencePair(self.prompt, self.chosen[:room], self.rejected[:room])

    def sequences(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """((ids, mask) of prompt + chosen, of prompt + rejected); mask True on response tokens."""
        out = []
        for response in (self.chosen, self.rejected):
            ids = np.concatenate([self.prompt, response]).astype(np.int32)
            mask = np.concatenate([np.zeros(len(self.prompt), bool), np.ones(len(response), bool)])
            out.append((ids, mask))
        return tuple(out)

    @property
    def tokens(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def _ids(a) -> np.ndarray:
    return np.asarray(a, np.int32)


def _response_messages(row: Mapping, key: str) -> list[dict]:
    value = row.get(key)
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRowError(f"conversational preference field {key!r} must be a non-empty list of assistant "
                              f"messages, found {'an empty list' if value == [] else a_type(value)}")
    messages = _messages({"messages": value}, DatasetSpec(path="-"))
    if any(m["role"] != "assistant" for m in messages):
        raise InvalidRowError(f"field {key!r} must hold assistant messages only, found roles "
                              f"{[m['role'] for m in messages]}")
    return messages


class PairFormatter:
    """row -> PreferencePair for one dataset (standard or conversational rows, told apart row by row)."""

    def __init__(self, tokenizer: Tokenizer, spec: DatasetSpec, chat_template: str | None = None):
        self.tokenizer, self.spec = tokenizer, spec
        self.template = _chat_template(tokenizer, chat_template, required=False)

    def __call__(self, row: Mapping[str, Any]) -> PreferencePair:
        spec = self.spec
        missing = [k for k in (spec.prompt_field, spec.chosen_field, spec.rejected_field) if k not in row]
        if missing:
            raise InvalidRowError(f"preference rows need the columns {spec.prompt_field!r}, {spec.chosen_field!r} "
                                  f"and {spec.rejected_field!r}; missing {missing} (columns: {sorted(row)})")
        prompt = row[spec.prompt_field]
        if isinstance(prompt, str):
            return self._standard(prompt, row[spec.chosen_field], row[spec.rejected_field])
        return self._conversational(row)

    def _standard(self, prompt: str, chosen, rejected) -> PreferencePair:
        for key, value in ((self.spec.chosen_field, chosen), (self.spec.rejected_field, rejected)):
            if not isinstance(value, str) or not value.strip():
                found = "an empty string" if isinstance(value, str) else a_type(value)
                raise InvalidRowError(f"standard preference field {key!r} must be a non-empty string (the prompt "
                                      f"is a string), found {found}")
        tok = self.tokenizer
        eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
        return PreferencePair(_ids(tok.encode(prompt, add_special_tokens=True)), _ids(tok.encode(chosen) + eos),
                              _ids(tok.encode(rejected) + eos))

    def _conversational(self, row: Mapping) -> PreferencePair:
        spec = self.spec
        if self.template is None:
            raise InvalidRowError("conversational preference rows (messages) need a chat template: the tokenizer "
                                  "has none; set `chat_template:`")
        prompt = _messages({"messages": row[spec.prompt_field]}, spec)
        tok = self.tokenizer
        try:
            prompt_text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                                  chat_template=self.template)
            responses = []
            for key in (spec.chosen_field, spec.rejected_field):
                full = tok.apply_chat_template(prompt + _response_messages(row, key), tokenize=False,
                                               chat_template=self.template)
                if not full.startswith(prompt_text):
                    raise InvalidRowError(f"the chat template does not render the prompt (with the generation "
                                          f"prompt) as a prefix of prompt + {key!r}; cannot split the response")
                responses.append(_ids(tok.encode(full[len(prompt_text):])))
        except ChatTemplateError as e:
            raise InvalidRowError(str(e)) from None
        return PreferencePair(_ids(tok.encode(prompt_text)), *responses)


class PreferenceRows(Sequence):
    """Random-access rows over fitted pairs: row i = {tokens, positions, segment_ids, targets, loss_mask: [2, T],
    pair: i}. Built on access (the ids are kept, not the padded rows)."""

    max_runs = 2  # one sequence and a padding tail per row (attention.packed_backend's bound)

    def __init__(self, pairs: Sequence[PreferencePair], seq_len: int):
        self.pairs, self.seq_len = list(pairs), seq_len
        self.tokens = sum(p.tokens for p in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def efficiency(self) -> float:
        return self.tokens / max(1, 2 * len(self.pairs) * self.seq_len)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        rows = [example_to_row(ids, mask, self.seq_len) for ids, mask in self.pairs[i].sequences()]
        out = {k: np.stack([r[k] for r in rows]) for k in FIELDS}
        out["pair"] = np.int32(i)
        return out


def empty_pair_row(seq_len: int) -> dict[str, np.ndarray]:
    """A padding row (no response token: weighs 0 in the DPO loss); its "pair" is -1."""
    out = {k: np.zeros((2, seq_len), dt) for k, dt in FIELDS.items()}
    out["pair"] = np.int32(-1)
    return out


class PreferenceEvalLoader:
    """One pass over pair rows per `iter()`, in order, in global batches of `batch_size` pairs (this process's
    share of each); the last batch is padded with empty pairs."""

    def __init__(self, rows: PreferenceRows, batch_size: int, *, process_index: int | None = None,
                 process_count: int | None = None):
        self.process_index, self.process_count = _process(process_index, process_count)
        self.local_batch_size = _local_batch(batch_size, self.process_count)
        self.rows, self.batch_size = rows, batch_size
        self.num_batches = -(-len(rows) // batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        n, empty = len(self.rows), empty_pair_row(self.rows.seq_len)
        for b in range(self.num_batches):
            ids = range(b * self.batch_size + self.process_index, (b + 1) * self.batch_size, self.process_count)
            items = [self.rows[i] if i < n else empty for i in ids]
            yield {k: np.stack([r[k] for r in items]) for k in items[0]}


@dataclass
class PreferenceData:
    """The DPO run's data, with the attributes the Trainer reads of `surojax.data.pipeline.Data`."""

    train: TrainLoader
    eval: PreferenceEvalLoader | None
    stats: DataStats
    train_rows: PreferenceRows
    eval_rows: PreferenceRows | None = None


def load_pairs(spec: DatasetEntry, tokenizer: Tokenizer, *, sequence_len: int, skip_invalid_rows: bool = False,
               chat_template: str | None = None, stats: DataStats) -> list[PreferencePair]:
    """Read, tokenize and fit one preference dataset (type preference, or auto detected as preference)."""
    spec = dataset_spec(spec)
    read = ReadStats()
    formatter, why, out = PairFormatter(tokenizer, spec, chat_template), "set in the config", []
    first = True

    def fmt(row: dict[str, Any]) -> PreferencePair:  # the type is checked on the first row (auto: detected)
        nonlocal first, why
        if first and spec.type == "auto":
            kind, why = detect_type(row, spec)
            if kind != "preference":
                raise DataError(f"{spec.path}: DPO trains on preference pairs, but type auto found {kind} ({why}); "
                                f"set type: preference and prompt_field / chosen_field / rejected_field")
        elif first and spec.type != "preference":
            raise DataError(f"{spec.path}: DPO trains on type: preference datasets, not {spec.type}")
        first = False
        if row_has_images(row) or row_video(row):  # a named error, not a bad row: skip_invalid_rows would drop them
            raise DataError(f"{spec.path}: a row has images or a video; trainer: dpo trains on text pairs only in this "
                            "version (image rows train with trainer: sft)")
        return formatter(row)

    rows = spec_rows(spec, skip_invalid_rows=skip_invalid_rows, stats=read)
    for pair in formatted_rows(rows, fmt, skip_invalid_rows=skip_invalid_rows, read=read):
        fitted = pair.fit(sequence_len)
        if fitted is None:
            stats.dropped_unsupervised += 1
            continue
        stats.truncated += fitted is not pair
        out.append(fitted)
    stats.add_dataset(spec, "preference", why, read, len(out))
    return out


def build_preference_data(datasets: Sequence[DatasetEntry], tokenizer: Tokenizer, *, sequence_len: int,
                          batch_size: int, seed: int = 0, skip_invalid_rows: bool = False,
                          validation_split_ratio: float = 0.0, validation_datasets: Sequence[DatasetEntry] = (),
                          num_epochs: int | None = None, eval_batch_size: int | None = None,
                          chat_template: str | None = None, process_index: int | None = None,
                          process_count: int | None = None) -> PreferenceData:
    """Train loader (+ eval loader) over pair rows; `batch_size` / `eval_batch_size` count pairs of a GLOBAL
    batch. Stats count pairs as examples and rows, both sequences' tokens as tokens."""
    stats = DataStats(sequence_len=sequence_len)
    common = dict(sequence_len=sequence_len, skip_invalid_rows=skip_invalid_rows,
                  chat_template=chat_template_text(chat_template), stats=stats)
    pairs = [p for spec in datasets for p in load_pairs(spec, tokenizer, **common)]
    if validation_datasets:
        val = [p for spec in validation_datasets for p in load_pairs(spec, tokenizer, **common)]
    else:
        train_idx, val_idx = validation_split(len(pairs), validation_split_ratio, seed)
        pairs, val = [pairs[i] for i in train_idx], [pairs[i] for i in val_idx]
    if not pairs:
        raise DataError(f"no preference pairs left ({stats.summary()})")
    rows = PreferenceRows(pairs, sequence_len)
    stats.examples, stats.rows, stats.tokens = len(pairs), len(pairs), rows.tokens
    stats.supervised_tokens = sum(len(p.chosen) + len(p.rejected) for p in pairs)
    stats.packing_efficiency = rows.efficiency
    procs = dict(process_index=process_index, process_count=process_count)
    train = TrainLoader(rows, batch_size, seed=seed, num_epochs=num_epochs, **procs)
    eval_rows = eval_loader = None
    if val:
        eval_rows = PreferenceRows(val, sequence_len)
        stats.eval_examples, stats.eval_rows, stats.eval_tokens = len(val), len(val), eval_rows.tokens
        stats.eval_supervised_tokens = sum(len(p.chosen) + len(p.rejected) for p in val)
        eval_loader = PreferenceEvalLoader(eval_rows, eval_batch_size or batch_size, **procs)
    return PreferenceData(train=train, eval=eval_loader, stats=stats, train_rows=rows, eval_rows=eval_rows)
