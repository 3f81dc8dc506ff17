"""Loader: exact resume from a saved state, epochs, process sharding, validation split, eval pass, pipeline, debug."""
from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from surojax.data.debug import debug_print
from surojax.data.formats import Example
from surojax.data.loader import EvalLoader, TrainLoader
from surojax.data.packing import PackedRows
from surojax.data.pipeline import build_data, validation_split
from surojax.data.sources import DataError
from surojax.data.tokenizer import Tokenizer

FIX = Path(__file__).parents[1] / "fixtures"
T = 16


def rows(n=13):
    # Row i is recognisable: tokens[0] == i + 1.
    return PackedRows([Example.of([i + 1] + [7] * (i % 5), [True] * (1 + i % 5)) for i in range(n)], T, packing=False)


def ids(batch):
    return batch["tokens"][:, 0].tolist()


def test_resume_from_saved_state_gives_exactly_the_same_batches():
    a = TrainLoader(rows(), 4, seed=3)
    for _ in range(5):  # across an epoch boundary (13 rows / 4 per batch)
        next(a)
    state = json.loads(json.dumps(a.get_state()))
    expected = [next(a) for _ in range(7)]
    b = TrainLoader(rows(), 4, seed=3)
    b.set_state(state)
    assert b.step == 5
    for want in expected:
        got = next(b)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    with pytest.raises(ValueError, match="cannot resume"):
        TrainLoader(rows(14), 4, seed=3).set_state(state)


def test_epochs_cover_every_row_once_with_a_new_order_each_epoch():
    loader = TrainLoader(rows(12), 4, seed=0, num_epochs=2)
    got = [i for batch in loader for i in ids(batch)]
    assert loader.total_steps == 6 and len(got) == 24
    first, second = got[:12], got[12:]
    assert sorted(first) == sorted(second) == list(range(1, 13))
    assert first != second
    assert [i for b in TrainLoader(rows(12), 4, seed=0, num_epochs=2) for i in ids(b)] == got  # same seed
    assert [i for b in TrainLoader(rows(12), 4, seed=1, num_epochs=2) for i in ids(b)] != got


def test_processes_split_each_global_batch():
    whole = TrainLoader(rows(), 4, seed=5, process_index=0, process_count=1)
    parts = [TrainLoader(rows(), 4, seed=5, process_index=p, process_count=2) for p in range(2)]
    for _ in range(6):
        global_ids = ids(next(whole))
        local = [ids(next(p)) for p in parts]
        assert all(len(x) == 2 for x in local)
        assert sorted(local[0] + local[1]) == sorted(global_ids)
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        TrainLoader(rows(), 3, process_index=0, process_count=2)


def test_finite_stream_gives_every_process_the_same_step_count():
    counts = [sum(1 for _ in TrainLoader(rows(13), 4, seed=0, num_epochs=1, process_index=p, process_count=2))
              for p in range(2)]
    assert counts == [3, 3]


def test_validation_split_is_deterministic_by_seed():
    tr, va = validation_split(100, 0.1, seed=7)
    tr2, va2 = validation_split(100, 0.1, seed=7)
    np.testing.assert_array_equal(va, va2)
    np.testing.assert_array_equal(tr, tr2)
    assert len(va) == 10 and sorted(np.concatenate([tr, va]).tolist()) == list(range(100))
    assert validation_split(100, 0.1, seed=8)[1].tolist() != va.tolist()
    assert len(validation_split(5, 0.01, seed=0)[1]) == 1  # a positive ratio holds out at least one
    assert len(validation_split(5, 0.0, seed=0)[1]) == 0


def test_eval_loader_goes_once_over_every_row_padding_the_last_batch():
    r = rows(10)
    ev = EvalLoader(r, 4, process_index=0, process_count=1)
    batches = list(ev)
    assert len(ev) == len(batches) == 3
    got = [i for b in batches for i in ids(b)]
    assert got[:10] == list(range(1, 11)) and got[10:] == [0, 0]
    assert not batches[-1]["loss_mask"][2:].any()
    assert [ids(b) for b in ev] == [ids(b) for b in batches]  # iterable again, same pass
    per_proc = [[i for b in EvalLoader(r, 4, process_index=p, process_count=2) for i in ids(b)] for p in range(2)]
    assert sorted(i for i in per_proc[0] + per_proc[1] if i) == list(range(1, 11))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIX / "tokenizer")


def test_pipeline_end_to_end_stats_match_the_batches(tok):
    data = build_data([FIX / "data" / "chat.jsonl", {"path": str(FIX / "data" / "alpaca.json"), "type": "instruction"}],
                      tok, sequence_len=64, batch_size=2, seed=0, validation_split_ratio=0.25, num_epochs=1,
                      process_index=0, process_count=1)
    s = data.stats
    assert (s.examples, s.eval_examples) == (4, 2)
    assert [d["type"] for d in s.datasets] == ["conversation", "instruction"]
    assert s.rows == len(data.train_rows) and s.eval_rows == len(data.eval_rows)
    rows_all = [data.train_rows[i] for i in range(s.rows)]
    assert s.tokens == sum(int((r["segment_ids"] > 0).sum()) for r in rows_all)
    assert s.supervised_tokens == sum(int(r["loss_mask"].sum()) for r in rows_all)
    assert s.packing_efficiency == pytest.approx(s.tokens / (s.rows * 64))
    batches = list(data.train)
    assert all(b["tokens"].shape == (2, 64) for b in batches) and len(batches) == s.rows // 2
    assert sum(float(b["loss_mask"].sum()) for b in data.eval) == s.eval_supervised_tokens
    again = build_data([FIX / "data" / "chat.jsonl", {"path": str(FIX / "data" / "alpaca.json"), "type": "instruction"}],
                       tok, sequence_len=64, batch_size=2, seed=0, validation_split_ratio=0.25, num_epochs=1,
                       process_index=0, process_count=1)
    assert [e.ids.tolist() for e in again.examples(10)] == [e.ids.tolist() for e in data.examples(10)]
    assert "examples" in s.summary() and "packing efficiency" in s.summary()


def test_debug_print_marks_supervised_tokens(tok):
    data = build_data([FIX / "data" / "chat.jsonl"], tok, sequence_len=128, batch_size=1,
                      process_index=0, process_count=1)
    buf = io.StringIO()
    debug_print(data.examples(), tok, n=1, console=Console(file=buf, color_system=None, width=200))
    out = buf.getvalue()
    assert "example 0" in out
    assert "«Hello»" in out or "«H»" in out
    assert "«<|im_end|>»(509)" in out and "<|im_start|>(508)" in out and "«<|im_start|>" not in out


def test_no_examples_names_every_file_without_rows(tok, tmp_path, caplog):
    """... in the error alone: no warning line before it (one for a dataset left empty while others go on)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "train-0.jsonl").write_text("")
    (folder / "train-1.jsonl").write_text("\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError) as e, caplog.at_level(logging.WARNING):
        build_data([empty, folder], tok, sequence_len=64, batch_size=1, process_index=0, process_count=1)
    message = str(e.value)
    assert message.startswith("no training examples left") and not caplog.records
    for f in (empty, folder / "train-0.jsonl", folder / "train-1.jsonl"):
        assert f"no rows in {f}" in message
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "hello world"}) + "\n")
    with caplog.at_level(logging.WARNING):
        build_data([empty, text], tok, sequence_len=64, batch_size=1, process_index=0, process_count=1)
    assert [r.getMessage() for r in caplog.records] == [f"{empty} gave no examples: no rows in {empty}"]


def test_no_examples_says_what_became_of_the_rows(tok, tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "hello world " * 50}) + "\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(data))}: 1 rows read, 0 skipped as invalid, none left after formatting"):
        build_data([{"path": str(data), "type": "text"}], tok, sequence_len=8, batch_size=1, truncation="drop",
                   process_index=0, process_count=1)
