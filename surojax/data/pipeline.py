"""From dataset specs and a tokenizer to a train loader, an optional eval loader and the data's statistics.

    specs --sources--> rows --formats--> Examples --fit_pieces--> (validation split) --packing--> rows --loader-->

Everything is tokenized up front (in every process: the result is identical, and data sharding happens on
rows in the loader). Multiple training datasets are concatenated in order; the loader shuffles rows.
`validation_split_ratio` holds out a seeded random subset of the training examples; `validation_datasets`
give the eval set instead. A dataset is described by the config's `DatasetSpec` (surojax.config.data): `build_data`
takes those (or a path / a mapping of its keys) and plain arguments; `build_data_from_config` reads the same keys
from the config's `DataSection`.

Rows with images (chat_images.has_images: image content parts or an `images` column) go through image_rows
(tokenize_image_row, fit_image_example: never truncated) when the model takes images (`vision`, vision_data.py:
read from the model folder's config.json / preprocessor_config.json), and are refused by a DataError naming the
model otherwise (not skippable: the data and the model disagree, no row is bad). A row with a video (a video content
part, a `videos` column: chat_images.row_video) is refused by name (VideoRowError: a row the text path would read
with its videos silently dropped). Data holding an image row is
packed by `ImagePackedRows` (per row pixel_values / image_grid_thw / rope_positions) and batched by its `collate`
(image_batch.py); data without images keeps the text rows and batches exactly, whatever the model.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from surojax.config.data import DataSection, DatasetSpec
from surojax.data.chat_images import VideoRowError, has_images, row_video
from surojax.data.formats import Example, detect_type, fit_pieces, make_formatter, supervised_targets
from surojax.data.image_rows import ImageExample, ImagePackedRows, fit_image_example, tokenize_image_row
from surojax.data.loader import EvalLoader, TrainLoader
from surojax.data.packing import PackedRows
from surojax.data.sources import DataError, InvalidRowError, ReadStats, Row, read_rows
from surojax.data.tokenizer import Tokenizer
from surojax.data.vision_data import TextOnly, VisionData, model_vision
from surojax.hub import model_path

log = logging.getLogger(__name__)

DatasetEntry = DatasetSpec | str | Path | Mapping[str, Any]  # what build_data takes per dataset (see dataset_spec)
# the model's images (vision_data.py), or a function giving them when the first image row needs them
Vision = VisionData | TextOnly | Callable[[], VisionData | TextOnly]
# the config's truncation_strategy (Surogate's names) -> fit_pieces' mode
TRUNCATION = {"right": "truncate", "left": "left", "delete": "drop", "split": "split"}


def dataset_spec(entry: DatasetEntry) -> DatasetSpec:
    """A `datasets:` entry as the config's DatasetSpec: the spec itself, a path alone, or a mapping of its keys
    (validated as the config validates it)."""
    if isinstance(entry, DatasetSpec):
        return entry
    if isinstance(entry, (str, Path)):
        return DatasetSpec(path=str(entry))
    if isinstance(entry, Mapping):
        return DatasetSpec.model_validate(dict(entry))
    raise TypeError(f"a dataset entry is a DatasetSpec, a path or a mapping, got {type(entry).__name__}")


def spec_rows(spec: DatasetSpec, *, skip_invalid_rows: bool, stats: ReadStats) -> Iterator[Row]:
    """`read_rows` of the source a dataset entry names (path, split, subset, data_files, samples)."""
    return read_rows(spec.path, split=spec.split, subset=spec.subset, data_files=spec.data_files,
                     samples=spec.samples, skip_invalid_rows=skip_invalid_rows, stats=stats)


T = TypeVar("T")
SKIP_HINT = " (set skip_invalid_rows: true to skip such rows)"


def _data_error(where: str, e: Exception) -> Exception:
    return DataError(f"{where}: {e}{SKIP_HINT}")


def formatted_rows(rows: Iterable[Row], fmt: Callable[[dict[str, Any]], T], *, skip_invalid_rows: bool,
                   read: ReadStats, invalid: tuple[type[Exception], ...] = (InvalidRowError,),
                   error: Callable[[str, Exception], Exception] = _data_error) -> Iterator[T]:
    """`fmt(row)` of each (location, row), in order: the one row loop of every reader (SFT / PT examples, DPO
    pairs, GRPO prompts, eval_generation's examples); what it makes is then fitted by the caller. A row `fmt`
    refuses (an `invalid` exception) raises `error(location, exception)` (default: a DataError naming the row and
    skip_invalid_rows), or with `skip_invalid_rows` is counted in `read` (ReadStats.skip) and left out."""
    for where, row in rows:
        try:
            item = fmt(row)
        except invalid as e:
            if not skip_invalid_rows:
                raise error(where, e) from None
            read.skip(where, str(e))
            continue
        yield item


@dataclass
class DataStats:
    """What the pipeline made of the data (see the field comments; eval_* count the validation set)."""

    sequence_len: int = 0
    examples: int = 0              # training sequences after skips and drops
    tokens: int = 0                # real (non-padding) tokens of those sequences, after truncation
    supervised_tokens: int = 0     # positions with loss_mask 1 per epoch (targets that carry loss)
    rows: int = 0                  # rows of sequence_len per epoch (packed or one example each)
    packing_efficiency: float = 0.0  # tokens / (rows * sequence_len)
    skipped_rows: int = 0          # invalid source rows skipped (skip_invalid_rows)
    truncated: int = 0             # examples cut to their length limit (truncation "truncate" / "left")
    split: int = 0                 # extra examples made by cutting long ones into pieces (truncation "split")
    dropped_too_long: int = 0      # examples longer than sequence_len dropped (truncation="drop")
    dropped_unsupervised: int = 0  # examples with no supervised target left (e.g. the prompt fills sequence_len)
    eval_examples: int = 0
    eval_tokens: int = 0
    eval_supervised_tokens: int = 0
    eval_rows: int = 0
    images: int = 0                # images in the training examples (rows with images: image_rows.py)
    datasets: list[dict] = field(default_factory=list)  # per dataset: path, split, type, why, rows, skipped, examples
    prompts: bool = False          # GRPO prompt rows (data/prompts.py): examples are prompts, tokens their tokens;
                                   # nothing is supervised or packed (the completions are generated in training)

    def add_dataset(self, spec: DatasetSpec, kind: str, why: str, read: ReadStats, examples: int) -> None:
        """Count one dataset's read: its invalid rows skipped and its `datasets` entry (dataset_line's fields)."""
        self.skipped_rows += read.skipped
        self.datasets.append({"path": spec.path, "split": spec.split, "type": kind, "why": why, "rows": read.rows,
                              "skipped": read.skipped, "examples": examples,
                              "files_without_rows": [f for f, n in read.rows_per_file.items() if n == 0]})

    def summary(self) -> str:
        if self.prompts:
            s = (f"{self.examples:,} prompts, {self.tokens:,} prompt tokens ({self.tokens / max(self.examples, 1):.1f} "
                 "per prompt; the completions are generated in training)")
        else:
            s = (f"{self.examples:,} examples, {self.tokens:,} tokens ({self.supervised_tokens:,} supervised) in "
                 f"{self.rows:,} rows of {self.sequence_len}; packing efficiency {self.packing_efficiency:.1%}")
        if self.images:
            s += f"; {self.images:,} images"
        if self.eval_examples:
            s += f"; validation {self.eval_examples:,} examples / {self.eval_rows:,} rows"
        dropped = {"skipped invalid rows": self.skipped_rows, "truncated": self.truncated,
                   "pieces split off long examples": self.split,
                   "dropped as too long": self.dropped_too_long,
                   "dropped with nothing supervised": self.dropped_unsupervised}
        return s + "".join(f"; {n:,} {what}" for what, n in dropped.items() if n)


@dataclass
class Data:
    train: TrainLoader
    eval: EvalLoader | None
    stats: DataStats
    train_rows: PackedRows
    eval_rows: PackedRows | None = None

    def examples(self, n: int = 3) -> list[Example]:
        """The first n training examples (dataset order) for inspection, e.g. debug.debug_print (ImageExamples
        for rows with images)."""
        rows, count = self.train_rows, min(n, len(self.train_rows.offsets) - 1)
        if isinstance(rows, ImagePackedRows):
            return [rows.example_at(e) for e in range(count)]
        return [Example(*rows.example(e)) for e in range(count)]


def chat_template_text(chat_template: str | None) -> str | None:
    """The `chat_template:` key: a path to a .jinja file, or the template text itself."""
    if chat_template is None or "{" in chat_template:
        return chat_template
    p = Path(chat_template).expanduser()
    if not p.is_file():
        raise DataError(f"chat_template {chat_template!r} is neither a file nor a jinja template")
    return p.read_text(encoding="utf-8")


def row_has_images(row: Mapping[str, Any]) -> bool:
    """Whether a dataset row carries images: an `images` column, or a list of messages with image parts."""
    if row.get("images"):
        return True
    return any(isinstance(v, list) and v and all(isinstance(m, Mapping) for m in v) and has_images(v)
               for v in row.values())


def resolve_vision(vision: Vision | None) -> VisionData | TextOnly:
    if vision is None:
        return TextOnly("no model was given to the data pipeline (build_data's `vision`)")
    return vision() if callable(vision) else vision


def _once(vision: Vision | None) -> Vision | None:
    """`vision`, a function called at most once (the model folder is read when the first image row needs it)."""
    return functools.cache(vision) if callable(vision) else vision


def load_examples(spec: DatasetEntry, tokenizer: Tokenizer, *, sequence_len: int, train_on_inputs: bool = False,
                  skip_invalid_rows: bool = False, truncation: str = "truncate", chat_template: str | None = None,
                  stats: DataStats | None = None, use_chat_template: bool = True, template_family: str | None = None,
                  max_length: int | None = None, vision: Vision | None = None) -> list[Example]:
    """Read, format and fit one dataset (to `max_length`, default sequence_len, by `truncation`: formats
    TRUNCATION_MODES); counts go into `stats` (skips, truncation, the chosen type). Rows with images need
    `vision` to be the model's VisionData (module docstring)."""
    spec, stats = dataset_spec(spec), stats if stats is not None else DataStats(sequence_len=sequence_len)
    read = ReadStats()
    kind, why, out = spec.type, "set in the config", []
    formatter = None
    limit = max_length or sequence_len

    def fmt(row: dict[str, Any]) -> Example | None:  # the formatter is chosen on the first row (type auto: detected)
        nonlocal formatter, kind, why, vision
        if formatter is None:
            if kind == "auto":
                kind, why = detect_type(row, spec)
                log.info("%s: type auto -> %s (%s)", spec.path, kind, why)
            formatter = make_formatter(kind, tokenizer, spec, train_on_inputs=train_on_inputs,
                                       chat_template=chat_template, use_chat_template=use_chat_template,
                                       template_family=template_family)
        video = row_video(row)
        if video is not None:  # the text path would drop the video parts silently
            raise VideoRowError(f"{video}: videos are not supported in training rows yet, only images")
        if row_has_images(row):
            vision = resolve_vision(vision)
            if isinstance(vision, TextOnly):
                raise DataError(f"{spec.path}: a row has images but {vision.reason}; train on a Qwen3-VL / Qwen3.5 "
                                "vision-language checkpoint, or remove the images")
            if kind != "conversation" or not use_chat_template:
                raise DataError(f"{spec.path}: a row has images, which are read from conversation rows rendered "
                                f"by the chat template (the dataset is type {kind!r}"
                                f"{'' if use_chat_template else ', use_chat_template false'})")
            ex = tokenize_image_row(row, tokenizer, vision.processing, spec, chat_template=chat_template,
                                    train_on_inputs=train_on_inputs)
            return fit_image_example(ex, limit, truncation)
        return formatter(row)

    rows = spec_rows(spec, skip_invalid_rows=skip_invalid_rows, stats=read)
    for ex in formatted_rows(rows, fmt, skip_invalid_rows=skip_invalid_rows, read=read):
        if ex is None or isinstance(ex, ImageExample):  # image rows were fitted whole (or dropped) by fmt
            pieces = [] if ex is None else [ex]
        else:
            pieces = fit_pieces(ex, limit, truncation)
        if not pieces:
            stats.dropped_too_long += 1
            continue
        stats.truncated += pieces[0] is not ex and truncation != "split"
        stats.split += len(pieces) - 1
        for fitted in pieces:
            if supervised_targets(fitted) == 0:
                stats.dropped_unsupervised += 1
                continue
            out.append(fitted)
    if read.skipped:
        log.warning("%s: skipped %d invalid rows of %d", spec.path, read.skipped, read.rows + read.skipped)
    stats.add_dataset(spec, kind, why, read, len(out))
    return out


def dataset_line(entry: dict) -> str:
    """One `DataStats.datasets` entry as a line for people, e.g.
    `data/chat.jsonl (split train): conversation (set in the config); 12 rows read, 0 skipped, 12 examples`."""
    line = (f"{entry['path']} (split {entry['split']}): {entry['type']} ({entry['why']}); {entry['rows']:,} rows "
            f"read, {entry['skipped']:,} skipped as invalid, {entry['examples']:,} examples")
    return line + (f"; no rows in {', '.join(entry['files_without_rows'])}" if entry["files_without_rows"] else "")


def why_no_examples(entry: dict) -> str:
    """One `DataStats.datasets` entry that gave no examples -> which of its files had no rows, and what became of
    the rows it had."""
    parts = [f"no rows in {f}" for f in entry["files_without_rows"]]
    if entry["rows"] or entry["skipped"]:
        parts.append(f"{entry['rows']} rows read, {entry['skipped']} skipped as invalid, none left after "
                     f"formatting and fitting to sequence_len")
    return "; ".join(parts) or "no rows"


def validation_split(n: int, ratio: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices), both ascending; the validation set is a seeded random subset."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"validation_split_ratio must be in [0, 1), got {ratio}")
    n_val = 0 if ratio == 0 else max(1, round(n * ratio))
    if n_val >= n and n_val:
        raise DataError(f"validation_split_ratio {ratio} leaves no training examples out of {n}")
    held = np.random.default_rng(seed).permutation(n)[:n_val]
    is_val = np.zeros(n, bool)
    is_val[held] = True
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def build_data(datasets: Iterable[DatasetEntry], tokenizer: Tokenizer, *, sequence_len: int, batch_size: int,
               sample_packing: bool = True, seed: int = 0, train_on_inputs: bool = False,
               skip_invalid_rows: bool = False, truncation: str = "truncate", validation_split_ratio: float = 0.0,
               validation_datasets: Iterable[DatasetEntry] = (), num_epochs: int | None = None,
               eval_batch_size: int | None = None, chat_template: str | None = None,
               process_index: int | None = None, process_count: int | None = None, use_chat_template: bool = True,
               template_family: str | None = None, max_length: int | None = None,
               num_threads: int | None = None, vision: Vision | None = None) -> Data:
    """Train loader (+ eval loader) and stats. `batch_size` / `eval_batch_size` count rows of a GLOBAL batch.
    `num_threads`: the loaders' read threads (None: their default). `vision`: the model's images (VisionData,
    TextOnly, or a function giving one when the first image row is read; None: image rows are refused)."""
    datasets, validation_datasets = list(datasets), list(validation_datasets)
    if not datasets:
        raise DataError("no datasets given")
    if validation_split_ratio and validation_datasets:
        raise DataError("set either validation_split_ratio or validation_datasets, not both")
    chat_template = chat_template_text(chat_template)
    stats = DataStats(sequence_len=sequence_len)
    common = dict(sequence_len=sequence_len, train_on_inputs=train_on_inputs, skip_invalid_rows=skip_invalid_rows,
                  truncation=truncation, chat_template=chat_template, stats=stats,
                  use_chat_template=use_chat_template, template_family=template_family, max_length=max_length,
                  vision=_once(vision))
    examples = [ex for spec in datasets for ex in load_examples(spec, tokenizer, **common)]
    if validation_datasets:
        val_examples = [ex for spec in validation_datasets for ex in load_examples(spec, tokenizer, **common)]
    else:
        train_idx, val_idx = validation_split(len(examples), validation_split_ratio, seed)
        examples, val_examples = [examples[i] for i in train_idx], [examples[i] for i in val_idx]
    if not examples:  # the error alone names every dataset's reason (no warning line before it)
        empty = [d for d in stats.datasets[:len(datasets)] if d["examples"] == 0]
        raise DataError(f"no training examples left ({stats.summary()}); "
                        + "; ".join(f"{d['path']}: {why_no_examples(d)}" for d in empty))
    for d in stats.datasets:  # the run goes on without these
        if d["examples"] == 0:
            log.warning("%s gave no examples: %s", d["path"], why_no_examples(d))

    images = any(isinstance(e, ImageExample) for e in [*examples, *val_examples])
    model = resolve_vision(common["vision"]) if images else None

    def pack(exs: list[Example]) -> PackedRows:
        if images:  # every image row needed a VisionData
            return ImagePackedRows(exs, sequence_len, packing=sample_packing, vision=model)
        return PackedRows(exs, sequence_len, packing=sample_packing)

    rows = pack(examples)
    stats.examples, stats.tokens, stats.rows = len(examples), rows.tokens, len(rows)
    stats.supervised_tokens = sum(supervised_targets(e) for e in examples)
    stats.packing_efficiency = rows.efficiency
    stats.images = sum(len(e.image_grid_thw) for e in examples if isinstance(e, ImageExample))
    procs = dict(process_index=process_index, process_count=process_count)
    if num_threads is not None:
        procs["num_threads"] = num_threads
    if images:
        procs["batch_fn"] = rows.collate
    train = TrainLoader(rows, batch_size, seed=seed, num_epochs=num_epochs, **procs)
    eval_rows = eval_loader = None
    if val_examples:
        eval_rows = pack(val_examples)
        if images:
            procs["empty_row"] = eval_rows.empty_row()
        stats.eval_examples, stats.eval_tokens, stats.eval_rows = len(val_examples), eval_rows.tokens, len(eval_rows)
        stats.eval_supervised_tokens = sum(supervised_targets(e) for e in val_examples)
        eval_loader = EvalLoader(eval_rows, eval_batch_size or batch_size, **procs)
    return Data(train=train, eval=eval_loader, stats=stats, train_rows=rows, eval_rows=eval_rows)


def config_vision(cfg: DataSection) -> VisionData | TextOnly:
    """The images of the config's `model` (its folder's config.json / preprocessor_config.json), with the
    config's `max_pixels`."""
    model = getattr(cfg, "model", None)
    if model is None:
        return TextOnly("the config names no model")
    return model_vision(model_path(model, weights=False), max_pixels=cfg.max_pixels)


def build_data_from_config(cfg: DataSection, tokenizer: Tokenizer, *, batch_size: int, seed: int = 0,
                           num_epochs: int | None = None, **overrides) -> Data:
    """`build_data` with the data keys of the config (sequence_len, sample_packing, datasets ...); `overrides`
    are further `build_data` keywords."""
    kwargs = dict(sequence_len=cfg.sequence_len, sample_packing=cfg.sample_packing,
                  train_on_inputs=cfg.train_on_inputs, skip_invalid_rows=cfg.skip_invalid_rows,
                  validation_split_ratio=cfg.validation_split_ratio, validation_datasets=cfg.validation_datasets,
                  chat_template=cfg.chat_template, use_chat_template=cfg.use_chat_template,
                  template_family=cfg.template, max_length=cfg.max_length,
                  truncation=TRUNCATION[cfg.truncation_strategy], num_threads=cfg.dataloader_num_workers,
                  vision=lambda: config_vision(cfg))
    kwargs.update(overrides)
    return build_data(cfg.datasets, tokenizer, batch_size=batch_size, seed=seed, num_epochs=num_epochs, **kwargs)
