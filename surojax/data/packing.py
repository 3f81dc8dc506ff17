"""Sample packing: examples -> fixed rows of sequence_len tokens, following the batch contract (batch.py).

Bins are chosen by best-fit decreasing: examples longest first (ties by index), each into the open row with the
least room that still fits it, else a new row. Deterministic, and within a few percent of optimal on real
length distributions. Open rows are kept in buckets by remaining room (at most sequence_len distinct values),
so packing n examples costs O(n log T).

Inside a row the examples keep their dataset order, with segment ids 1..k, positions restarting at 0 for each,
and targets that never cross a segment: each segment is laid out exactly as `example_to_row` lays it out alone,
so a packed row computes the same loss as its examples run one per row. With packing off each example gets its
own row (padded). Rows are built on access from flat token arrays, so memory is ~5 bytes per real token.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np

from surojax.data.batch import FIELDS
from surojax.data.formats import Example


def best_fit_decreasing(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Bins of example indices (each bin's lengths sum to <= seq_len); indices inside a bin ascending."""
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # remaining room -> open bins with that room (a stack)
    rooms: list[int] = []               # sorted distinct rooms that have an open bin
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        if not 0 < n <= seq_len:
            raise ValueError(f"example {i} has {n} tokens; packing needs 1..{seq_len} (truncate first)")
        j = bisect_left(rooms, n)
        if j < len(rooms):
            room = rooms[j]
            b = buckets[room].pop()
            if not buckets[room]:
                rooms.pop(j)
        else:
            room, b = seq_len, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            if not buckets.get(left):
                buckets[left] = []
                insort(rooms, left)
            buckets[left].append(b)
    return [sorted(b) for b in bins]


def one_per_row(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


class PackedRows:
    """Random-access rows (dicts of [T] arrays per the batch contract) over tokenized examples.

    `PackedRows(examples, seq_len, packing=True)`; len() rows; rows[i] builds row i; `efficiency` is real
    tokens / (rows * seq_len).
    """

    def __init__(self, examples: Sequence[Example], seq_len: int, packing: bool = True):
        lengths = np.fromiter((len(e) for e in examples), np.int64, len(examples))
        if len(lengths) and lengths.max() > seq_len:
            raise ValueError(f"an example has {lengths.max()} tokens > sequence_len {seq_len} (truncate first)")
        self.seq_len = seq_len
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # example e is flat[offsets[e]:offsets[e+1]]
        self.ids = np.concatenate([e.ids for e in examples]).astype(np.int32) if examples else np.zeros(0, np.int32)
        self.mask = np.concatenate([e.mask for e in examples]).astype(bool) if examples else np.zeros(0, bool)
        self.bins = best_fit_decreasing(lengths.tolist(), seq_len) if packing else one_per_row(len(examples))
        self.tokens = int(lengths.sum())

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def efficiency(self) -> float:
        return self.tokens / max(1, len(self.bins) * self.seq_len)

    @property
    def max_runs(self) -> int:
        """The most runs of equal segment ids in any row (its samples, plus the padding tail when the row is
        not full): the bound cuDNN's packed attention needs (`attention.packed_backend`)."""
        if not self.bins:
            return 1
        lengths = np.diff(self.offsets)
        return max(len(b) + int(int(lengths[b].sum()) < self.seq_len) for b in self.bins)

    def example(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[e], self.offsets[e + 1]
        return self.ids[a:b], self.mask[a:b]

    def empty_row(self) -> dict[str, np.ndarray]:
        """A padding row (segment id 0 everywhere, nothing supervised), e.g. to fill the eval loader's last batch."""
        return {k: np.zeros((self.seq_len,), dt) for k, dt in FIELDS.items()}

    def __getitem__(self, r: int) -> dict[str, np.ndarray]:
        return build_row([self.example(e) for e in self.bins[r]], self.seq_len)


def build_row(segments: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """One row holding `segments` [(ids, mask)] back to back; each exactly as example_to_row would lay it out."""
    row = {k: np.zeros((seq_len,), dt) for k, dt in FIELDS.items()}
    at = 0
    for k, (ids, mask) in enumerate(segments, 1):
        n = len(ids)
        if at + n > seq_len:
            raise ValueError(f"segments hold more than {seq_len} tokens")
        row["tokens"][at:at + n] = ids
        row["positions"][at:at + n] = np.arange(n)
        row["segment_ids"][at:at + n] = k
        row["targets"][at:at + n - 1] = ids[1:]       # the last token of a segment predicts nothing
        row["loss_mask"][at:at + n - 1] = mask[1:]
        at += n
    return row
