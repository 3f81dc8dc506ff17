"""grain loaders over packed rows: a shuffled, sharded, checkpointable train iterator and a one-pass eval iterator.

Global view: the train stream is the rows shuffled by `seed` (a new permutation every epoch), repeated
`num_epochs` times (None = forever), cut into global batches of `batch_size` rows. Process p of P gets the rows
p, p + P, p + 2P ... of each global batch, i.e. a local batch of batch_size / P rows, so that the union over
processes of step s is global batch s whatever P is (build the global array with
`jax.make_array_from_process_local_data`). A finite stream is cut to whole global batches so that every
process runs the same number of steps.

`get_state()` is a small JSON-serialisable dict (the global step and grain's iterator state);
`set_state(state)` on a loader built over the same data resumes with exactly the batches that would have come
next. It refuses a state taken over different data (row count, seed, batch size, epochs).

`batch_fn` batches a list of rows (default: grain's stacking into [B, ...]); rows with images pass
`ImagePackedRows.collate` (image_batch.py: ragged pixel_values concatenated and padded to buckets), and the eval
loader then pads its last batch with `empty_row` (`ImagePackedRows.empty_row()`, which has the image keys).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import grain
import numpy as np

from surojax.data.batch import FIELDS

STATE_VERSION = 1
BatchFn = Callable[[Sequence[dict[str, np.ndarray]]], dict[str, np.ndarray]]  # rows -> a batch (image_batch.py)


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    return process_index, process_count


def _local_batch(batch_size: int, process_count: int) -> int:
    if batch_size <= 0 or batch_size % process_count:
        raise ValueError(f"the global batch size ({batch_size} rows) must be a positive multiple of the number of "
                         f"processes ({process_count})")
    return batch_size // process_count


def _read_options(num_threads: int, prefetch: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)


class TrainLoader:
    """Iterator of this process's share of each global batch: dict of [batch_size / P, T] arrays."""

    def __init__(self, rows: Sequence[dict[str, np.ndarray]], batch_size: int, *, seed: int = 0,
                 num_epochs: int | None = None, shuffle: bool = True, process_index: int | None = None,
                 process_count: int | None = None, num_threads: int = 2, prefetch: int = 8,
                 batch_fn: BatchFn | None = None):
        if len(rows) == 0:
            raise ValueError("no training rows")
        self.process_index, self.process_count = _process(process_index, process_count)
        self.local_batch_size = _local_batch(batch_size, self.process_count)
        self.batch_size, self.seed, self.num_epochs, self.num_rows = batch_size, seed, num_epochs, len(rows)
        ds = grain.MapDataset.source(rows)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.repeat(num_epochs, reseed_each_epoch=True)
        if num_epochs is not None:
            ds = ds[:len(ds) // batch_size * batch_size]
        ds = ds[self.process_index::self.process_count].batch(self.local_batch_size, drop_remainder=True,
                                                                batch_fn=batch_fn)
        self._ds = ds.to_iter_dataset(_read_options(num_threads, prefetch))
        self._it = iter(self._ds)
        self.step = 0

    @property
    def total_steps(self) -> int | None:
        return None if self.num_epochs is None else self.num_rows * self.num_epochs // self.batch_size

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._it)
        self.step += 1
        return batch

    def _fingerprint(self) -> dict:
        return {"rows": self.num_rows, "seed": self.seed, "batch_size": self.batch_size,
                "num_epochs": self.num_epochs}

    def get_state(self) -> dict:
        return {"version": STATE_VERSION, "step": self.step, "grain": self._it.get_state(), **self._fingerprint()}

    def set_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data iterator state of version {state.get('version')}, expected {STATE_VERSION}")
        saved = {k: state.get(k) for k in self._fingerprint()}
        if saved != self._fingerprint():
            raise ValueError(f"cannot resume the data iterator: it was saved over {saved} but the data now gives "
                             f"{self._fingerprint()} (the dataset, seed, batch size or epochs changed)")
        self._it.close()
        self._it = iter(self._ds)
        self._it.set_state(state["grain"])
        self.step = int(state["step"])

    def close(self) -> None:
        """Stop grain's prefetch threads (idempotent)."""
        self._it.close()


class EvalLoader:
    """One pass over validation rows per `iter()`; the last global batch is padded with empty rows (loss_mask 0)."""

    def __init__(self, rows: Sequence[dict[str, np.ndarray]], batch_size: int, *, process_index: int | None = None,
                 process_count: int | None = None, num_threads: int = 2, prefetch: int = 8,
                 batch_fn: BatchFn | None = None, empty_row: dict[str, np.ndarray] | None = None):
        self.process_index, self.process_count = _process(process_index, process_count)
        self.local_batch_size = _local_batch(batch_size, self.process_count)
        self.batch_size, self.num_rows = batch_size, len(rows)
        self.num_batches = -(-len(rows) // batch_size)
        seq_len = len(rows[0]["tokens"]) if len(rows) else 0
        empty = empty_row if empty_row is not None else {k: np.zeros((seq_len,), dt) for k, dt in FIELDS.items()}
        n = len(rows)
        ds = grain.MapDataset.range(self.num_batches * batch_size).map(lambda i: rows[i] if i < n else empty)
        ds = ds[self.process_index::self.process_count].batch(self.local_batch_size, batch_fn=batch_fn)
        self._ds = ds.to_iter_dataset(_read_options(num_threads, prefetch))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter(self._ds)
