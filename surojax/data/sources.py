"""Dataset sources: local files and folders -> dict rows, each with where it came from.

Readers: JSONL, JSON (a list of objects or {"data": [...]}), Parquet, CSV, Arrow (IPC file or stream), a
`datasets.save_to_disk` folder (dataset_info.json / state.json + *.arrow shards, or a DatasetDict folder
with one subfolder per split), and a plain folder of such files (files are chosen by `split` when their
names say which split they hold). A Hugging Face dataset id that is not a local path resolves only through
the local HF hub cache (surojax.hub); nothing is downloaded.

Every row comes with a location ("file.jsonl:12", 1-based line or row number) so that an invalid row is
reported where the user can find it. `skip_invalid_rows` turns such errors into a counted skip (`ReadStats`).
pyarrow is imported only when a Parquet / Arrow file is read.
"""
from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surojax.hub import ModelNotFoundError, resolve_local
from surojax.wording import json_error, json_type

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".arrow")
_SHOWN_SKIPS = 5  # invalid rows logged one by one before only the count is kept


class DataError(ValueError):
    """A dataset cannot be read as asked (missing path, unknown format, invalid row without skipping)."""

    is_user_error = True


class InvalidRowError(ValueError):
    """One row cannot be used; the caller adds its location and either raises a `DataError` or skips it."""

    is_user_error = True


@dataclass
class ReadStats:
    """Counts of one read: rows yielded and rows skipped as invalid (with the first few reasons)."""

    rows: int = 0
    skipped: int = 0
    skip_examples: list[str] = field(default_factory=list)
    rows_per_file: dict[str, int] = field(default_factory=dict)  # valid rows of each file read (in read order)

    def skip(self, where: str, reason: str) -> None:
        self.skipped += 1
        if len(self.skip_examples) < _SHOWN_SKIPS:
            self.skip_examples.append(f"{where}: {reason}")
            log.warning("skipping invalid row %s: %s", where, reason)


Row = tuple[str, dict[str, Any]]  # (location, row)


def read_rows(path: str | os.PathLike, *, split: str = "train", subset: str | None = None,
              samples: int | None = None, skip_invalid_rows: bool = False,
              stats: ReadStats | None = None) -> Iterator[Row]:
    """Yield (location, row) for the dataset at `path` (see the module docstring for what `path` may be).

    `samples` stops after that many valid rows. An invalid row raises `DataError` naming the file and row,
    or, with `skip_invalid_rows`, is skipped and counted in `stats`.
    """
    stats = stats if stats is not None else ReadStats()
    files = resolve_files(path, split=split, subset=subset)
    if samples is not None and samples <= 0:
        raise DataError(f"samples must be positive, got {samples}")
    for f in files:
        stats.rows_per_file[str(f)] = 0
        for where, row in _read_file(f):
            if isinstance(row, InvalidRowError):
                if not skip_invalid_rows:
                    raise DataError(f"{where}: {row} (set skip_invalid_rows: true to skip such rows)")
                stats.skip(where, str(row))
                continue
            stats.rows += 1
            stats.rows_per_file[str(f)] += 1
            yield where, row
            if samples is not None and stats.rows >= samples:
                return


# ---------------------------------------------------------------------------------------------- resolution

def resolve_files(path: str | os.PathLike, *, split: str = "train", subset: str | None = None) -> list[Path]:
    """The data files behind `path` for `split` (and `subset`), in a fixed order."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        try:
            p = resolve_local(str(path), kind="dataset")
        except ModelNotFoundError as e:
            raise DataError(str(e)) from None
    if p.is_file():
        return [p]
    if subset is not None and subset != "default":
        if not (p / subset).is_dir():
            have = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
            raise DataError(f"{p}: no subset folder {subset!r} (folders: {have or 'none'})")
        p = p / subset
    if (p / "dataset_dict.json").is_file():  # datasets.DatasetDict.save_to_disk
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits or not (p / split).is_dir():
            raise DataError(f"{p}: saved DatasetDict has splits {splits}, not {split!r} (set `split:`)")
        p = p / split
    if (p / "state.json").is_file():  # datasets.Dataset.save_to_disk
        state = json.loads((p / "state.json").read_text())
        names = [d["filename"] for d in state.get("_data_files", [])] or sorted(
            f.name for f in p.glob("*.arrow"))
        if not names:
            raise DataError(f"{p}: a save_to_disk folder without .arrow shards")
        return [p / n for n in names]
    return _split_files(p, split)


def _split_files(folder: Path, split: str) -> list[Path]:
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES
                   and not any(part.startswith(".") for part in f.relative_to(folder).parts)
                   and f.name not in ("dataset_info.json", "state.json", "dataset_dict.json"))
    if not files:
        raise DataError(f"{folder}: no data files ({', '.join(SUFFIXES)}) in this folder")
    named = [f for f in files if _names_split(f.relative_to(folder), split)]
    if named:
        return named
    if any(_names_split(f.relative_to(folder), s) for f in files for s in _KNOWN_SPLITS):
        raise DataError(f"{folder}: no files for split {split!r} (files are named by split; set `split:`)")
    return files


_KNOWN_SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")


def _names_split(rel: Path, split: str) -> bool:
    """True if a path inside a dataset folder says it holds `split` (train.jsonl, data/train-0000.parquet ...)."""
    if split in rel.parts[:-1]:
        return True
    stem = rel.name.split(".")[0]
    return stem == split or any(stem.startswith(split + sep) for sep in "-_")


# ------------------------------------------------------------------------------------------------- readers

def _read_file(f: Path) -> Iterator[tuple[str, dict | InvalidRowError]]:
    suffix = f.suffix.lower()
    reader = _READERS.get(suffix)
    if reader is None:
        raise DataError(f"{f}: unknown data file type {suffix!r} (expected one of {', '.join(SUFFIXES)})")
    yield from reader(f)


def _checked(row: Any) -> dict | InvalidRowError:
    if isinstance(row, dict):
        return row
    return InvalidRowError(f"expected a JSON object, found {json_type(row)}")


def _read_jsonl(f: Path):
    with open(f, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{f}:{i}"
            try:
                yield where, _checked(json.loads(line))
            except json.JSONDecodeError as e:
                yield where, InvalidRowError(f"invalid JSON ({json_error(e, line=False)})")


def _read_json(f: Path):
    text = f.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # Some .json files are really JSON lines.
        if text.lstrip().startswith("{") and "\n" in text.strip():
            yield from _read_jsonl(f)
            return
        raise DataError(f"{f}: invalid JSON ({json_error(e)})") from None
    if isinstance(data, dict):
        if isinstance(data.get("data"), list):
            data = data["data"]
        else:
            raise DataError(f"{f}: expected a list of objects or {{\"data\": [...]}}, got an object with keys "
                            f"{sorted(data)[:8]}")
    if not isinstance(data, list):
        raise DataError(f"{f}: expected a list of objects, found {json_type(data)}")
    for i, row in enumerate(data, 1):
        where = f"{f} row {i}"
        yield where, _checked(row)


def _read_csv(f: Path):
    with open(f, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            where = f"{f}:{reader.line_num}"
            if None in row:
                yield where, InvalidRowError(f"more fields than the {len(reader.fieldnames)} columns of the header")
            elif any(v is None for v in row.values()):
                yield where, InvalidRowError(f"fewer fields than the {len(reader.fieldnames)} columns of the header")
            else:
                yield where, row


def _arrow_batches(f: Path, read_table: Callable):
    table = read_table(f)
    n = 0
    for batch in table.to_batches(max_chunksize=1024):
        for row in batch.to_pylist():
            n += 1
            yield f"{f} row {n}", row


def _read_parquet(f: Path):
    pq = _pyarrow("parquet")
    yield from _arrow_batches(f, lambda p: pq.read_table(p))


def _read_arrow(f: Path):
    ipc = _pyarrow("ipc")

    def read(p):
        try:
            with ipc.open_file(p) as r:  # Arrow IPC file format (Feather v2)
                return r.read_all()
        except Exception:  # noqa: BLE001 - not the file format: try the stream format (datasets' shards)
            with open(p, "rb") as fh, ipc.open_stream(fh) as r:
                return r.read_all()

    yield from _arrow_batches(f, read)


def _pyarrow(module: str):
    try:
        import importlib
        return importlib.import_module(f"pyarrow.{module}")
    except ImportError:
        raise DataError("reading Parquet / Arrow files needs pyarrow: pip install pyarrow") from None


_READERS = {".jsonl": _read_jsonl, ".ndjson": _read_jsonl, ".json": _read_json, ".csv": _read_csv,
            ".parquet": _read_parquet, ".arrow": _read_arrow}
