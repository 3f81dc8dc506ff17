"""Dataset sources: local files and folders, or Hugging Face Hub datasets -> dict rows, each with where it came from.

Readers: JSONL, JSON (a list of objects or {"data": [...]}), Parquet, CSV, Arrow (IPC file or stream), a
`datasets.save_to_disk` folder (dataset_info.json / state.json + *.arrow shards, or a DatasetDict folder
with one subfolder per split), and a plain folder of such files (files are chosen by `split` when their
names say which split they hold, or by `data_files` patterns). A name that is not a local path and reads as a
Hub dataset id (org/name[@revision]) is loaded through `datasets.load_dataset` with `subset` / `split` /
`data_files` (surojax.hub: its cache, offline too).

Every row comes with a location ("file.jsonl:12", 1-based line or row number; "org/name[train]:row 12" for a
Hub dataset) so that an invalid row is reported where the user can find it. `skip_invalid_rows` turns such
errors into a counted skip (`ReadStats`).
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

from surojax.hub import HubError, load_dataset, missing_name, parse_hub_id
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


DataFiles = str | list[str] | dict[str, str | list[str]]  # as datasets.load_dataset takes them


def read_rows(path: str | os.PathLike, *, split: str = "train", subset: str | None = None,
              data_files: DataFiles | None = None, samples: int | None = None, skip_invalid_rows: bool = False,
              stats: ReadStats | None = None) -> Iterator[Row]:
    """Yield (location, row) for the dataset at `path` (see the module docstring for what `path` may be).

    `samples` stops after that many valid rows. An invalid row raises `DataError` naming the file and row,
    or, with `skip_invalid_rows`, is skipped and counted in `stats`.
    """
    stats = stats if stats is not None else ReadStats()
    if samples is not None and samples <= 0:
        raise DataError(f"samples must be positive, got {samples}")
    for source, rows in _sources(path, split, subset, data_files):
        stats.rows_per_file[source] = 0
        for where, row in rows:
            if isinstance(row, InvalidRowError):
                if not skip_invalid_rows:
                    raise DataError(f"{where}: {row} (set skip_invalid_rows: true to skip such rows)")
                stats.skip(where, str(row))
                continue
            stats.rows += 1
            stats.rows_per_file[source] += 1
            yield where, row
            if samples is not None and stats.rows >= samples:
                return


def _sources(path: str | os.PathLike, split: str, subset: str | None, data_files: DataFiles | None):
    """(source name, its (location, row) iterator) for each file of a local dataset, or the one Hub split."""
    name = os.fspath(path)
    if not Path(name).expanduser().exists() and parse_hub_id(name, "dataset") is not None:
        try:
            ds = load_dataset(name, subset=subset, split=split, data_files=data_files)
        except HubError as e:
            raise DataError(str(e)) from None
        label = f"{name}{f'({subset})' if subset else ''}[{split}]"
        yield label, ((f"{label}:row {i}", _checked(row)) for i, row in enumerate(ds, 1))
        return
    for f in resolve_files(path, split=split, subset=subset, data_files=data_files):
        yield str(f), _read_file(f)


# ---------------------------------------------------------------------------------------------- resolution

def resolve_files(path: str | os.PathLike, *, split: str = "train", subset: str | None = None,
                  data_files: DataFiles | None = None) -> list[Path]:
    """The local data files behind `path` for `split` (and `subset`, `data_files`), in a fixed order."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise DataError(missing_name(path, "dataset"))
    if p.is_file():
        if data_files is not None:
            raise DataError(f"{p}: data_files picks files inside a folder or Hub repo; this path is one file")
        return [p]
    if subset is not None and subset != "default":
        if not (p / subset).is_dir():
            have = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
            raise DataError(f"{p}: no subset folder {subset!r} (folders: {have or 'none'})")
        p = p / subset
    if data_files is not None:
        return _matching_files(p, data_files, split)
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


def _matching_files(folder: Path, data_files: DataFiles, split: str) -> list[Path]:
    """The files of `folder` that `data_files` names for `split` (glob patterns relative to the folder; a
    string or list is the train split, as in datasets.load_dataset)."""
    by_split = data_files if isinstance(data_files, dict) else {"train": data_files}
    if split not in by_split:
        raise DataError(f"{folder}: data_files names the splits {sorted(by_split)}, not {split!r} (set `split:`)")
    patterns = [by_split[split]] if isinstance(by_split[split], str) else list(by_split[split])
    files = []
    for pattern in patterns:
        found = sorted(f for f in folder.glob(pattern) if f.is_file())
        if not found:
            raise DataError(f"{folder}: no file matches data_files pattern {pattern!r}")
        files += [f for f in found if f not in files]
    return files


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
