"""GGUF split files: one model in N files `<prefix>-00001-of-0000N.gguf` .. `<prefix>-0000N-of-0000N.gguf`, as
llama.cpp's gguf-split and gguf-py's GGUFWriter (`split_max_tensors` / `split_max_size`) write them.

    gf = read_gguf_model("qwen3-q4_k_m-00002-of-00003.gguf")   # any part's name (or an unsplit file)
    gf.fields, gf.tensors                                      # the first part's metadata, every part's tensors

The layout (llama.cpp examples/gguf-split, gguf-py GGUFWriter.add_shard_kv_data): every part is a whole GGUF file
(header, metadata, tensor infos, its own data section, offsets relative to it) holding some of the tensors, and
carries `split.no` (u16, 0-based), `split.count` (u16, N) and `split.tensors.count` (i32, the tensors of all
parts together); the first part also carries the model's metadata (architecture, hyperparameters, tokenizer), the
others only the split keys. A first part may hold no tensors (gguf-split --no-tensor-first-split, GGUFWriter
small_first_shard). llama.cpp finds the other parts by their names, as here.

Checks, each a GGUFError naming the file: every part is read by the checked reader (surojax.weights.gguf_reader:
counts and offsets bounded by that file's bytes); a part that is missing names the file expected; each part's
split.no / split.count are the ones its name says; every part agrees on split.tensors.count, and the parts hold
exactly that many tensors; no tensor name is in two parts. The result is one GGUFFile: the first part's header
and metadata (split keys included), and the tensors of all parts in part order (each a view of its own file).
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from surojax.weights.gguf_reader import GGUFError, GGUFFile, read_gguf

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def part_path(prefix: Path, no: int, count: int) -> Path:
    """The file name of part `no` (1-based) of `count`: llama.cpp's llama_split_path, `%s-%05d-of-%05d.gguf`."""
    return prefix.with_name(f"{prefix.name}-{no:05d}-of-{count:05d}.gguf")


def split_name(path: str | os.PathLike) -> tuple[Path, int, int] | None:
    """(prefix, part number (1-based), part count) when the file name is a split part's, else None."""
    p = Path(path)
    m = _PART_NAME.match(p.name)
    if m is None:
        return None
    return p.with_name(m["prefix"]), int(m["no"]), int(m["count"])


def model_name(path: str | os.PathLike) -> str:
    """A short name for the model in `path`: the file's stem, without the split suffix of a part."""
    parts = split_name(path)
    return parts[0].name if parts is not None else Path(path).stem


def _split_keys(gf: GGUFFile) -> tuple[int, int, int] | None:
    """(split.no, split.count, split.tensors.count) of one file, None when it carries no split keys."""
    present = [k for k in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS) if k in gf.fields]
    if not present:
        return None
    values = []
    for key in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS):
        v = gf.fields.get(key)
        if type(v) is not int or v < 0:
            found = "it is missing" if key not in gf.fields else f"found {type(v).__name__} {v!r}"
            raise GGUFError(f"{gf.path}: metadata key {key}: expected a non-negative integer (the file carries "
                            f"{', '.join(present)}), {found}")
        values.append(v)
    no, count, total = values
    if not no < count:
        raise GGUFError(f"{gf.path}: metadata keys split.no {no} and split.count {count}: expected split.no < "
                        "split.count")
    return no, count, total


def read_gguf_model(path: str | os.PathLike) -> GGUFFile:
    """A GGUF model from `path`: an unsplit file as read_gguf reads it, or every part of a split model named by
    any one part (module docstring). Raises GGUFError."""
    given = read_gguf(path)
    keys = _split_keys(given)
    if keys is None or keys[1] == 1:
        return given
    no, count, _ = keys
    named = split_name(given.path)
    if named is None:
        raise GGUFError(f"{given.path}: part {no + 1} of a model split in {count} files (metadata split.no / "
                        f"split.count), but its name does not end in -{no + 1:05d}-of-{count:05d}.gguf, so the "
                        "other parts cannot be found: keep the part names gguf-split gave them")
    prefix, name_no, name_count = named
    if (name_no, name_count) != (no + 1, count):
        raise GGUFError(f"{given.path}: its name says part {name_no} of {name_count}, its metadata (split.no "
                        f"{no}, split.count {count}) says part {no + 1} of {count}")
    parts = []
    for k in range(1, count + 1):
        p = part_path(prefix, k, count)
        if k == no + 1:
            parts.append(given)
            continue
        if not p.is_file():
            raise GGUFError(f"{given.path}: part {k} of {count} of this split model is missing: expected {p}")
        gf = read_gguf(p)
        got = _split_keys(gf)
        if got is None or got[:2] != (k - 1, count):
            found = "no split keys" if got is None else f"split.no {got[0]}, split.count {got[1]}"
            raise GGUFError(f"{p}: expected part {k} of {count} (split.no {k - 1}, split.count {count}) of the "
                            f"model {given.path} belongs to, found {found}")
        parts.append(gf)
    return _joined(parts)


def _joined(parts: list[GGUFFile]) -> GGUFFile:
    """The parts (checked one by one, in order) as one GGUFFile, after the checks across them."""
    first = parts[0]
    totals = {gf.path: _split_keys(gf)[2] for gf in parts}
    if len(set(totals.values())) > 1:
        listing = ", ".join(f"{p.name}: {t}" for p, t in totals.items())
        raise GGUFError(f"{first.path}: the parts disagree on split.tensors.count ({listing}); expected one total")
    tensors, where = [], {}
    for gf in parts:
        for t in gf.tensors:
            if t.name in where:
                raise GGUFError(f"{gf.path}: tensor {t.name!r} is also in {where[t.name]}: expected each tensor in "
                                "one part")
            where[t.name] = gf.path.name
            tensors.append(t)
    total = totals[first.path]
    if len(tensors) != total:
        held = ", ".join(f"{gf.path.name}: {len(gf.tensors)}" for gf in parts)
        raise GGUFError(f"{first.path}: split.tensors.count says {total} tensors, the {len(parts)} parts hold "
                        f"{len(tensors)} ({held})")
    return dataclasses.replace(first, tensors=tensors)


__all__ = ["read_gguf_model", "split_name", "part_path", "model_name", "SPLIT_NO", "SPLIT_COUNT", "SPLIT_TENSORS"]
