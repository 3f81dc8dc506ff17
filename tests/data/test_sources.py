"""Readers: every file type, folders and split selection, data_files, malformed rows, skips and samples (Hub
datasets: tests/test_hub.py)."""
from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from surojax.data.sources import DataError, ReadStats, read_rows, resolve_files

ROWS = [{"text": "alpha", "n": 1}, {"text": "beta", "n": 2}, {"text": "gamma", "n": 3}]


def rows_of(path, **kw):
    return [row for _, row in read_rows(path, **kw)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_arrow_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as f, ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    return path


def save_to_disk_folder(folder, rows, shards=2):
    """The layout datasets.Dataset.save_to_disk writes: arrow stream shards + state.json + dataset_info.json."""
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-len(rows) // shards)
    for i, name in enumerate(names):
        write_arrow_stream(folder / name, rows[i * per:(i + 1) * per])
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "x", "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def test_jsonl_json_list_and_data_key(tmp_path):
    assert rows_of(write_jsonl(tmp_path / "a.jsonl", ROWS)) == ROWS
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    assert rows_of(tmp_path / "b.json") == ROWS
    (tmp_path / "c.json").write_text(json.dumps({"data": ROWS, "version": 1}))
    assert rows_of(tmp_path / "c.json") == ROWS


def test_parquet_csv_arrow_file_and_stream(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    assert rows_of(tmp_path / "a.parquet") == ROWS
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["text", "n"])
        w.writeheader()
        w.writerows(ROWS)
    assert rows_of(tmp_path / "a.csv") == [{"text": r["text"], "n": str(r["n"])} for r in ROWS]
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    assert rows_of(tmp_path / "file.arrow") == ROWS
    assert rows_of(write_arrow_stream(tmp_path / "stream.arrow", ROWS)) == ROWS


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    assert rows_of(save_to_disk_folder(tmp_path / "ds", ROWS)) == ROWS
    dd = tmp_path / "dd"
    save_to_disk_folder(dd / "train", ROWS)
    save_to_disk_folder(dd / "test", ROWS[:1], shards=1)
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert rows_of(dd) == ROWS
    assert rows_of(dd, split="test") == ROWS[:1]
    with pytest.raises(DataError, match="splits.*'validation'"):
        rows_of(dd, split="validation")


def test_folder_of_files_chosen_by_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "test.jsonl", ROWS[2:])
    assert rows_of(tmp_path) == ROWS[:2]
    assert rows_of(tmp_path, split="test") == ROWS[2:]
    hub = tmp_path / "hub_layout"
    (hub / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), hub / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[1:]), hub / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), hub / "data" / "validation-00000-of-00001.parquet")
    assert rows_of(hub) == ROWS
    with pytest.raises(DataError, match="no files for split 'dev'"):
        rows_of(hub, split="dev")
    plain = tmp_path / "plain"
    plain.mkdir()
    write_jsonl(plain / "part1.jsonl", ROWS[:1])
    write_jsonl(plain / "part2.jsonl", ROWS[1:])
    assert rows_of(plain) == ROWS  # no split in the names: every file, in name order


def test_data_files_pick_files_of_a_local_folder(tmp_path):
    """data_files as datasets.load_dataset takes it: patterns in the folder; a string / list is the train split."""
    d = tmp_path / "d"
    (d / "more").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", ROWS[:1])
    write_jsonl(d / "more" / "b.jsonl", ROWS[1:2])
    write_jsonl(d / "more" / "c.jsonl", ROWS[2:])
    assert rows_of(d, data_files="more/*.jsonl") == ROWS[1:]
    assert rows_of(d, data_files=["more/c.jsonl", "a.jsonl"]) == [ROWS[2], ROWS[0]]
    assert rows_of(d, data_files={"train": "a.jsonl", "test": ["more/b.jsonl"]}, split="test") == ROWS[1:2]
    with pytest.raises(DataError, match=r"data_files names the splits \['train'\], not 'test'"):
        rows_of(d, data_files="a.jsonl", split="test")
    with pytest.raises(DataError, match="no file matches data_files pattern 'none/\\*.jsonl'"):
        rows_of(d, data_files="none/*.jsonl")
    with pytest.raises(DataError, match="this path is one file"):
        rows_of(d / "a.jsonl", data_files="a.jsonl")


def test_a_missing_path_is_named(tmp_path):
    for name in (str(tmp_path / "nope" / "x.jsonl"), "./data/train.jsonl", "data/train.jsonl"):
        with pytest.raises(DataError, match="does not exist .and is not a Hugging Face Hub dataset id"):
            rows_of(name)


def test_malformed_rows_name_file_and_line_or_are_skipped_and_counted(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n\n{"text": broken}\n[1, 2]\n{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        rows_of(p)
    stats = ReadStats()
    got = list(read_rows(p, skip_invalid_rows=True, stats=stats))
    assert [(where.rsplit(":", 1)[1], row) for where, row in got] == [("1", {"text": "ok"}), ("5", {"text": "fine"})]
    assert (stats.rows, stats.skipped) == (2, 3)
    assert "bad.jsonl:4: expected a JSON object, found an array" in stats.skip_examples[1]
    assert "bad.jsonl:6: invalid JSON (Invalid control character at column 14)" in stats.skip_examples[2]  # not "at at"

    (tmp_path / "bad.json").write_text(json.dumps([{"a": 1}, "oops"]))
    with pytest.raises(DataError, match=r"bad\.json row 2: expected a JSON object"):
        rows_of(tmp_path / "bad.json")
    (tmp_path / "bad.csv").write_text("text,n\nok,1\ntoo,many,fields\n")
    with pytest.raises(DataError, match=r"bad\.csv:3: more fields"):
        rows_of(tmp_path / "bad.csv")


def test_samples_takes_the_first_valid_rows(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "a"}\nnot json\n{"text": "b"}\n{"text": "c"}\n')
    assert rows_of(p, samples=2, skip_invalid_rows=True) == [{"text": "a"}, {"text": "b"}]
    assert rows_of(p, samples=1) == [{"text": "a"}]  # stops before reaching the bad line


def test_unknown_file_type_and_empty_folder(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unknown data file type"):
        rows_of(tmp_path / "x.txt")
    with pytest.raises(DataError, match="no data files"):
        resolve_files(tmp_path)
