"""Reading and writing the safetensors file format, with errors that name the file and the tensor.

The format: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
raw little-endian tensor bytes. Read through a memory map, so a tensor is only paged in when used. We parse it
ourselves (instead of `safetensors.numpy`) to get bf16 through ml_dtypes and to check truncation and
corruption before any tensor is used.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class WeightsError(ValueError):
    """A checkpoint that cannot be read as asked: the message names the file and the tensor."""

    is_user_error = True


class SafetensorsFile:
    """A read-only view of one .safetensors file: `names()`, `shape(name)`, `dtype(name)`, `get(name)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise WeightsError(f"{self.path}: file not found")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{self.path}: not a safetensors file (only {size} bytes; truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise WeightsError(f"{self.path}: corrupt or truncated safetensors header "
                                   f"(header says {n} bytes, file has {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WeightsError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        self._entries = header
        data_size = size - self._data_start
        for name, e in header.items():
            if isinstance(e, dict) and isinstance(e.get("dtype"), str) and e["dtype"] not in DTYPES:
                raise WeightsError(f"{self.path}: tensor {name!r} has dtype {e['dtype']}, which surojax cannot read "
                                   f"(supported: {', '.join(DTYPES)})")
            try:
                dtype = DTYPES[e["dtype"]]
                begin, end = e["data_offsets"]
                shape = tuple(int(d) for d in e["shape"])
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{self.path}: tensor {name!r} has a malformed header entry {e!r}") from None
            if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)) or begin < 0:
                raise WeightsError(f"{self.path}: tensor {name!r} header is inconsistent "
                                   f"(shape {list(shape)} {e['dtype']} vs {end - begin} bytes)")
            if end > data_size:
                raise WeightsError(f"{self.path}: truncated: tensor {name!r} ends at byte {self._data_start + end} "
                                   f"but the file has {size} bytes")
        self._mmap = None

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._entries[name]["dtype"]]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array backed by the file's memory map."""
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        e = self._entries[name]
        begin, end = e["data_offsets"]
        buf = memoryview(self._mmap)[self._data_start + begin:self._data_start + end]
        return np.frombuffer(buf, dtype=DTYPES[e["dtype"]]).reshape(e["shape"])


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write `tensors` (numpy arrays; bf16 via ml_dtypes) to `path` in the safetensors format."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        arr = np.ascontiguousarray(arr).reshape(arr.shape)  # ascontiguousarray alone makes a 0-d tensor [1]
        if arr.dtype not in NAMES:
            raise WeightsError(f"tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
