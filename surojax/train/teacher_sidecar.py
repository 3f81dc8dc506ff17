"""The distillation teacher, precomputed: a sidecar folder of top-K log-probs per supervised position.

`surojax distill CONFIG --precompute` runs the teacher once over the tokenized rows (training and validation) and
writes; a run with `teacher_logprobs: <folder>` reads it and never loads the teacher:

    <folder>/meta.json     format, version, teacher, top_k, sequence_len, dtype, rows, positions, vocabulary hash
    <folder>/row_keys.npy  uint8 [R, 16]   blake2b of each row's (tokens, segment_ids, targets, loss_mask)
    <folder>/offsets.npy   int64 [R + 1]   row r's supervised positions are entries offsets[r]:offsets[r + 1]
    <folder>/ids.npy       int32 [N, K]    teacher top-K ids per supervised position, in row order
    <folder>/logps.npy     float16 | float32 [N, K]  their log-probs (full-vocabulary log_softmax at T = 1)

Rows are keyed by their content, not by their place in the data order: whatever the shuffle, the epoch, the
number of processes or a resume, a batch row finds its teacher entries, and a row the teacher never saw (other data,
another sequence_len or packing) is an error naming the sidecar. The .npy files are memory-mapped when read.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from surojax.data.tokenizer import Tokenizer
from surojax.train.run_spec import TrainSetupError
from surojax.train.teacher_topk import OnlineTeacher

FORMAT, VERSION = "surojax-teacher-topk", 1
DTYPES = {"float16": np.float16, "float32": np.float32}


def row_key(row: dict[str, np.ndarray]) -> bytes:
    """16 bytes naming one packed row [T] by what the loss reads of it."""
    h = hashlib.blake2b(digest_size=16)
    for name, dt in (("tokens", np.int32), ("segment_ids", np.int32), ("targets", np.int32),
                     ("loss_mask", np.float32)):
        h.update(np.ascontiguousarray(row[name], dt).tobytes())
    return h.digest()


def vocabulary_hash(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's token -> id map (added tokens included)."""
    vocab = sorted(tokenizer.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def write_teacher_sidecar(out: str | Path, rows: Sequence[dict[str, np.ndarray]], teacher: OnlineTeacher, *,
                          tokenizer: Tokenizer, sequence_len: int, dtype: str = "float16") -> Path:
    """Run `teacher` over `rows` (each a dict of [T] arrays, surojax/data/batch.py) `teacher.rows` at a time and
    write the sidecar folder `out` (atomically: a temporary folder renamed at the end). Returns `out`."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    R, K = len(rows), teacher.top_k
    counts = np.array([int(np.count_nonzero(rows[r]["loss_mask"] > 0)) for r in range(R)], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    N = int(offsets[-1])
    keys = np.zeros((R, 16), np.uint8)
    ids = np.lib.format.open_memmap(tmp / "ids.npy", mode="w+", dtype=np.int32, shape=(N, K))
    logps = np.lib.format.open_memmap(tmp / "logps.npy", mode="w+", dtype=DTYPES[dtype], shape=(N, K))
    for start in range(0, R, teacher.rows):
        part = [rows[r] for r in range(start, min(start + teacher.rows, R))]
        batch = {k: np.stack([row[k] for row in part]) for k in ("tokens", "positions", "segment_ids", "loss_mask")}
        top = teacher.topk(batch)
        for j, row in enumerate(part):
            r = start + j
            keys[r] = np.frombuffer(row_key(row), np.uint8)
            sup = row["loss_mask"] > 0
            ids[offsets[r]:offsets[r + 1]] = top["teacher_ids"][j][sup]
            # fp16: a log-prob below -65504 stays finite (-inf would make 0 * inf = nan in the loss)
            logps[offsets[r]:offsets[r + 1]] = np.maximum(top["teacher_logps"][j][sup], np.finfo(logps.dtype).min)
    ids.flush()
    logps.flush()
    del ids, logps
    np.save(tmp / "row_keys.npy", keys)
    np.save(tmp / "offsets.npy", offsets)
    meta = {"format": FORMAT, "version": VERSION, "teacher": teacher.name, "top_k": K, "sequence_len": sequence_len,
            "dtype": dtype, "rows": R, "positions": N, "vocabulary": vocabulary_hash(tokenizer)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@dataclasses.dataclass(frozen=True)
class SidecarTeacher:
    """Top-K teacher log-probs read from a sidecar folder (same `topk(batch)` as OnlineTeacher)."""

    path: Path
    meta: dict
    index: dict  # row key -> row number
    offsets: np.ndarray
    ids: np.ndarray  # memory-mapped [N, K]
    logps: np.ndarray

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    @classmethod
    def open(cls, path: str | Path, tokenizer: Tokenizer, *, top_k: int, sequence_len: int,
             teacher: str | None = None) -> SidecarTeacher:
        """Open and check a sidecar against the run: the same tokenizer, sequence_len and top_k (and the same
        `teacher` reference when the config names one). TrainSetupError naming the mismatch otherwise."""
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise TrainSetupError(f"teacher_logprobs: {path} is not a teacher sidecar folder (no meta.json); write one "
                                  "with `surojax distill CONFIG --precompute`")
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise TrainSetupError(f"teacher_logprobs: {path} is not a {FORMAT} v{VERSION} sidecar")
        wanted = {"top_k": ("teacher_top_k", top_k), "sequence_len": ("sequence_len", sequence_len)}
        if teacher is not None:
            wanted["teacher"] = ("teacher", teacher)
        for field, (key, value) in wanted.items():
            if meta[field] != value:
                raise TrainSetupError(f"{key}: {value!r} but the sidecar {path} was written with {meta[field]!r}; "
                                      "run --precompute again with this config")
        if meta["vocabulary"] != vocabulary_hash(tokenizer):
            raise TrainSetupError(f"teacher_logprobs: {path} was written with another tokenizer than this run's")
        keys = np.load(path / "row_keys.npy", allow_pickle=False)
        return cls(path=path, meta=meta, index={k.tobytes(): r for r, k in enumerate(keys)},
                   offsets=np.load(path / "offsets.npy", allow_pickle=False),
                   ids=np.load(path / "ids.npy", mmap_mode="r", allow_pickle=False),
                   logps=np.load(path / "logps.npy", mmap_mode="r", allow_pickle=False))

    def topk(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A host batch [N, T] -> {teacher_ids int32, teacher_logps float32} [N, T, K] (zeros where loss_mask is
        0). Every row with a supervised position must be in the sidecar."""
        n, T = batch["tokens"].shape
        ids = np.zeros((n, T, self.top_k), np.int32)
        logps = np.zeros((n, T, self.top_k), np.float32)
        for j in range(n):
            row = {k: batch[k][j] for k in ("tokens", "segment_ids", "targets", "loss_mask")}
            sup = row["loss_mask"] > 0
            if not sup.any():
                continue  # an empty (padding) row of an eval batch
            r = self.index.get(row_key(row))
            if r is None:
                raise TrainSetupError(f"teacher_logprobs: a batch row is not in {self.path} (it was precomputed over "
                                      "other data, packing or sequence_len); run --precompute again with this config")
            ids[j, sup] = self.ids[self.offsets[r]:self.offsets[r + 1]]
            logps[j, sup] = self.logps[self.offsets[r]:self.offsets[r + 1]]
        return {"teacher_ids": ids, "teacher_logps": logps}
