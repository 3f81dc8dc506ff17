"""Packing: every example exactly once, rows equal to the examples run alone, no target across segments."""
from __future__ import annotations

import numpy as np
import pytest

from surojax.data.batch import FIELDS, example_to_row
from surojax.data.formats import Example
from surojax.data.packing import PackedRows, best_fit_decreasing

T = 32


def random_examples(n, seed=0, max_len=T):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(2, max_len + 1))
        out.append(Example(rng.integers(1, 500, L).astype(np.int32), rng.random(L) < 0.6))
    return out


def test_best_fit_decreasing_places_each_example_once_within_capacity():
    lengths = [int(x) for x in np.random.default_rng(1).integers(1, T + 1, 300)]
    bins = best_fit_decreasing(lengths, T)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= T for b in bins)
    assert all(b == sorted(b) for b in bins)
    assert len(bins) <= 1.1 * np.ceil(sum(lengths) / T) + 1  # near the lower bound
    assert best_fit_decreasing(lengths, T) == bins  # deterministic
    assert best_fit_decreasing([5, 3, 8, 2, 6], 8) == [[2], [3, 4], [0, 1]]
    with pytest.raises(ValueError, match="needs 1..8"):
        best_fit_decreasing([9], 8)


def test_packed_rows_equal_unpacked_rows_segment_by_segment():
    examples = random_examples(200, max_len=T // 2)
    packed = PackedRows(examples, T, packing=True)
    assert len(packed) < len(examples) / 2.5
    seen = []
    for r in range(len(packed)):
        row = packed[r]
        assert {k: v.dtype for k, v in row.items()} == {k: np.dtype(v) for k, v in FIELDS.items()}
        at = 0
        for k, e in enumerate(packed.bins[r], 1):
            ex = examples[e]
            n = len(ex)
            alone = example_to_row(ex.ids, ex.mask, T)
            for key in ("tokens", "positions", "targets", "loss_mask"):
                np.testing.assert_array_equal(row[key][at:at + n], alone[key][:n], err_msg=key)
            assert (row["segment_ids"][at:at + n] == k).all()
            at += n
            seen.append(e)
        assert not row["segment_ids"][at:].any() and not row["loss_mask"][at:].any() and not row["tokens"][at:].any()
        boundary = row["segment_ids"][:-1] != row["segment_ids"][1:]
        assert not row["loss_mask"][:-1][boundary].any()  # no token predicts the next segment's first token
    assert sorted(seen) == list(range(len(examples)))
    total = sum(float(packed[r]["loss_mask"].sum()) for r in range(len(packed)))
    assert total == sum(int(e.mask[1:].sum()) for e in examples)
    assert packed.efficiency == pytest.approx(sum(map(len, examples)) / (len(packed) * T))
    assert packed.efficiency > 0.9


def test_without_packing_each_row_is_example_to_row():
    examples = random_examples(10, seed=3)
    rows = PackedRows(examples, T, packing=False)
    assert len(rows) == 10
    for i, ex in enumerate(examples):
        alone = example_to_row(ex.ids, ex.mask, T)
        for key in FIELDS:
            np.testing.assert_array_equal(rows[i][key], alone[key])


def test_too_long_example_is_refused():
    with pytest.raises(ValueError, match="truncate first"):
        PackedRows(random_examples(3, max_len=T + 8, seed=5) + [Example.of(np.ones(T + 1), np.ones(T + 1))], T)


@pytest.mark.parametrize("packing", [True, False])
def test_max_runs_bounds_every_row(packing):
    """PackedRows.max_runs (the cuDNN packed-attention bound M) equals the most runs any built row has, counting
    the padding tail as cuDNN's packed layout does."""
    from surojax.models.layers.attention import packed_segments, runs_per_row

    rows = PackedRows(random_examples(60, seed=3), T, packing=packing)
    built = np.stack([rows[i]["segment_ids"] for i in range(len(rows))])
    assert rows.max_runs == runs_per_row(built) == int(packed_segments(built, 64)[2].max())
    full = PackedRows([Example(np.arange(1, T + 1, dtype=np.int32), np.ones(T, bool))], T)
    assert full.max_runs == 1  # a full one-sample row: no padding run
