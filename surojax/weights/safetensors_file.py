"""Reading and writing .safetensors files through the `safetensors` package's numpy API, with errors that name
the file and the tensor.

The format: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
raw little-endian tensor bytes.

What the package does (safetensors 0.8.0, checked in tests/weights/test_safetensors_file.py):
- `safe_open(path, framework="numpy")` memory-maps the file and validates the whole header when it opens (JSON,
  dtypes, shapes vs byte ranges, ranges contiguous and covering the file exactly), so a truncated or corrupt
  file fails before any tensor is used. Its messages name neither the tensor nor the sizes ("incomplete
  metadata, file not fully covered"), so on a refusal `_explain` re-reads the header to say which tensor and
  what was expected vs found. That diagnosis runs only on files the package refused.
- `get_tensor` returns a copy of the tensor (writeable, not backed by the map): a caller converts one tensor at
  a time and drops it (surojax.weights.hf_checkpoint does) to keep host memory near one model.
- bf16 is read and written as ml_dtypes.bfloat16. F8_E4M3 / F8_E5M2 are written, but reading them raises
  AttributeError (the package looks their dtype up on the numpy module, which has none); `_read_raw` reads those
  two from the validated header's byte range instead.
- `save_file` writes the raw buffer of a non-contiguous array as if it were contiguous (a transposed view comes
  back transposed wrong), so `write_safetensors` makes every array contiguous first. It writes to a temporary
  name and renames, so a crash never leaves a half file under the real name.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from surojax.weights.atomic import atomic_path

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NAMES = {v: k for k, v in DTYPES.items()}
_RAW_READ = frozenset({"F8_E4M3", "F8_E5M2"})  # the numpy API cannot build these dtypes (module docstring)
_MAX_HEADER = 100 * 2**20


class WeightsError(ValueError):
    """A checkpoint that cannot be read as asked: the message names the file and the tensor."""

    is_user_error = True


class SafetensorsError(WeightsError):
    """A .safetensors file that cannot be read: the message names the file, the tensor, and expected vs found."""


class SafetensorsFile:
    """A read-only view of one .safetensors file: `names()`, `shape(name)`, `dtype(name)`, `get(name)`, `metadata`.

    Opening validates the whole header (a SafetensorsError naming the file, and the tensor where one is at fault);
    `get` copies one tensor out of the memory map.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise SafetensorsError(f"{self.path}: file not found")
        try:
            self._file = safe_open(str(self.path), framework="numpy")
        except SafetensorError as e:
            raise SafetensorsError(_explain(self.path, str(e))) from None
        self.metadata: dict[str, str] = self._file.metadata() or {}
        self._entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name in self._file.offset_keys():
            view = self._file.get_slice(name)
            code = view.get_dtype()
            if code not in DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {code}, which surojax cannot read "
                                   f"(supported: {', '.join(DTYPES)})")
            self._entries[name] = (code, tuple(int(d) for d in view.get_shape()))

    def names(self) -> list[str]:
        """Tensor names in file order (the order of their bytes)."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._entries[name][0]]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array of `shape(name)` and `dtype(name)` (a copy; the file is not changed)."""
        if name not in self._entries:
            raise SafetensorsError(f"{self.path}: no tensor {name!r}")
        if self._entries[name][0] in _RAW_READ:
            return _read_raw(self.path, name, DTYPES[self._entries[name][0]], self.shape(name))
        return self._file.get_tensor(name)


def _read_header(path: Path) -> tuple[int, dict]:
    """(header length N, the parsed header) of a file the package has already validated."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _read_raw(path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    n, header = _read_header(path)
    begin, end = header[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(8 + n + begin)
        return np.frombuffer(f.read(end - begin), dtype=dtype).reshape(shape)


def _explain(path: Path, refusal: str) -> str:
    """Why the package refused `path`, naming the tensor and the sizes where the header says which; else the
    package's own reason. Reads at most the header (never more than the file holds)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path}: not a safetensors file (only {size} bytes; truncated?)"
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            return f"{path}: corrupt or truncated safetensors header (header says {n} bytes, file has {size})"
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"{path}: corrupt safetensors header ({e})"
    except RecursionError:
        return f"{path}: corrupt safetensors header (JSON nested deeper than the parser allows)"
    if not isinstance(header, dict):
        return f"{path}: corrupt safetensors header (not a JSON object)"
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, e in header.items():
        if isinstance(e, dict) and isinstance(e.get("dtype"), str) and e["dtype"] not in DTYPES:
            return (f"{path}: tensor {name!r} has dtype {e['dtype']}, which surojax cannot read "
                    f"(supported: {', '.join(DTYPES)})")
        try:
            itemsize = DTYPES[e["dtype"]].itemsize
            begin, end = (int(v) for v in e["data_offsets"])
            shape = [int(d) for d in e["shape"]]
        except (KeyError, TypeError, ValueError):
            return f"{path}: tensor {name!r} has a malformed header entry {e!r}"
        if begin < 0 or end - begin != itemsize * math.prod(shape):
            return (f"{path}: tensor {name!r} header is inconsistent "
                    f"(shape {shape} {e['dtype']} vs {end - begin} bytes)")
        if end > data_size:
            return f"{path}: truncated: tensor {name!r} ends at byte {8 + n + end} but the file has {size} bytes"
    return f"{path}: not a valid safetensors file ({refusal})"


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write `tensors` (numpy arrays; bf16 / fp8 via ml_dtypes) to `path` in the safetensors format, atomically
    (`atomic_path`: a temporary file in the same folder, renamed at the end, with the usual new-file mode, not the
    0600 of safetensors' own temporary file). Default metadata: {"format": "pt"}."""
    path = Path(path)
    arrays = {}
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype not in NAMES:
            raise WeightsError(f"{path}: tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors "
                               f"(supported: {', '.join(str(d) for d in NAMES)})")
        arrays[name] = np.ascontiguousarray(arr).reshape(arr.shape)  # ascontiguousarray alone makes a 0-d tensor [1]
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata=dict(metadata or {"format": "pt"}))
