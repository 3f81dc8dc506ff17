"""A GGUF file's header and tensor table, parsed and checked against the file's size before anything is allocated.

    gf = read_gguf("model.gguf")       # GGUFError on anything malformed (file, key / tensor, expected vs found)
    gf.fields["general.architecture"]  # key -> Python value (int, float, bool, str, or a list of those)
    t = gf.tensors[0]; t.name, t.tensor_type, t.shape, t.data   # shape in GGUF `ne` order; data a read-only view

The format (GGUF v2 / v3, little-endian): magic "GGUF", version u32, tensor count u64, KV count u64; KV pairs
(key string, value type u32, value); tensor infos (name string, n_dims u32, n_dims x u64 dims, ggml type u32,
offset u64); padding to `general.alignment` (default 32); the tensor data, each tensor at its offset from the start
of the data section. A string is a u64 length and that many UTF-8 bytes; an array is an item type u32, a u64 count
and the items.

Why not `gguf.GGUFReader`: it trusts every count and length (a truncated or corrupt file gives numpy's
"cannot reshape array" / IndexError, or tries to allocate what a corrupt count claims). Here every count and length
is checked against the bytes left in the file before anything is read or allocated, every loop is bounded by the
file's size, and tensors are checked for known ggml types, at most 4 dims, byte sizes that fit the file, aligned
offsets inside the data section and no two tensors overlapping. Tensor data is a view of a read-only memory map,
in the layout GGUFReader gives (F16 / F32 / F64 / I8..I64 as that dtype in numpy order, every other type as
uint8 rows of block bytes), so `gguf.quants.dequantize` reads it as it reads GGUFReader's.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from surojax.weights.safetensors_file import WeightsError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype); bool is one byte
_SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
            5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "|b1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
            12: ("<d", "<f8")}
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_PLAIN = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


class GGUFError(WeightsError):
    """A .gguf file that cannot be read: the message names the file, the key or tensor, and expected vs found."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a checked GGUF file. shape: GGUF `ne` order (ne[0] = the contiguous row length);
    begin / nbytes: its absolute byte range in the file."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    _buffer: mmap.mmap

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def data(self) -> np.ndarray:
        """A read-only view of the bytes: numpy order (reversed `shape`); block types as uint8 [..., row bytes]."""
        np_shape = tuple(reversed(self.shape))
        plain = _PLAIN.get(self.tensor_type)
        if plain is not None:
            return np.frombuffer(self._buffer, plain, self.n_elements, self.begin).reshape(np_shape)
        block, type_size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        byte_shape = (*np_shape[:-1], np_shape[-1] // block * type_size)
        return np.frombuffer(self._buffer, np.uint8, self.nbytes, self.begin).reshape(byte_shape)


@dataclass(frozen=True)
class GGUFFile:
    """A checked GGUF file: `fields` (key -> Python value, file order) and `tensors` (file order)."""

    path: Path
    version: int
    fields: dict
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int


class _Cursor:
    """Reads little-endian values from `buf`, refusing any read past its end (named after `what`)."""

    def __init__(self, buf, size: int, source: str):
        self.buf, self.size, self.source, self.pos = buf, size, source, 0

    def fail(self, what: str, expected: str, found: str):
        raise GGUFError(f"{self.source}: not a readable GGUF file: {what}: expected {expected}, found {found} "
                        f"(at byte {self.pos} of {self.size})")

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            self.fail(what, f"{n} more bytes", f"{self.left()} (file truncated or a corrupt length)")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"{what} (string length)")
        if n > self.left():
            self.fail(what, f"a string of at most {self.left()} bytes (what is left of the file)",
                      f"a length of {n}")
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(what, "a UTF-8 string", f"invalid byte {raw[e.start]:#04x} at string offset {e.start}")
        self.pos += n
        return s

    def value(self, vtype: int, what: str, in_array: bool = False):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and not in_array:
            return self.array(what)
        self.bad_type(vtype, what, in_array)

    def bad_type(self, vtype: int, what: str, in_array: bool):
        self.fail(what, "a value type among " + ", ".join(f"{k} ({v})" for k, v in _TYPE_NAMES.items()
                                                            if not (in_array and k == _ARRAY)),
                  f"type {vtype}" + (" (nested arrays are not supported)" if vtype == _ARRAY else ""))

    def array(self, what: str) -> list:
        itype = self.unpack("<I", f"{what} (array item type)")
        count = self.unpack("<Q", f"{what} (array length)")
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype][1])
            if count > self.left() // dtype.itemsize:
                self.fail(what, f"at most {self.left() // dtype.itemsize} {_TYPE_NAMES[itype]} items (what is left "
                                f"of the file)", f"an array length of {count}")
            out = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return out
        if itype != _STRING:
            self.bad_type(itype, f"{what} (array item type)", in_array=True)
        if count > self.left() // 8:
            self.fail(what, f"at most {self.left() // 8} strings (what is left of the file)",
                      f"an array length of {count}")
        return [self.string(f"{what}[{i}]") for i in range(count)]


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and check `path` (module docstring). Raises GGUFError; nothing larger than the file is allocated."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise GGUFError(f"{source}: GGUF file not found")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{source}: not a readable GGUF file: expected a header of at least 24 bytes, found a "
                        f"file of {size} bytes (truncated?)")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, size, source)
    magic = bytes(buf[:4])
    if magic != MAGIC:
        cur.fail("magic", repr(MAGIC), repr(magic))
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        cur.fail("version", f"one of {SUPPORTED_VERSIONS}", f"{version}{hint}")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata key count")
    if n_kv > cur.left() // (8 + 4 + 1):
        cur.fail("metadata key count", f"at most {cur.left() // 13} (what is left of the file)", str(n_kv))

    fields: dict = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in fields:
            cur.fail(f"metadata key {key!r}", "each key once", "a duplicate")
        vtype = cur.unpack("<I", f"metadata key {key!r} (value type)")
        fields[key] = cur.value(vtype, f"metadata key {key!r}")

    if n_tensors > cur.left() // _MIN_TENSOR_INFO:
        cur.fail("tensor count", f"at most {cur.left() // _MIN_TENSOR_INFO} (what is left of the file)",
                 str(n_tensors))
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i} name")
        what = f"tensor {name!r}"
        n_dims = cur.unpack("<I", f"{what} (dimension count)")
        if not 1 <= n_dims <= MAX_DIMS:
            cur.fail(f"{what} dimension count", f"1 to {MAX_DIMS}", str(n_dims))
        shape = tuple(cur.unpack("<Q", f"{what} (dimension {d})") for d in range(n_dims))
        raw_type = cur.unpack("<I", f"{what} (type)")
        offset = cur.unpack("<Q", f"{what} (offset)")
        infos.append((name, shape, raw_type, offset))

    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        cur.fail("metadata key 'general.alignment'", "a power of two", repr(alignment))
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _check_tensors(infos, buf, size, data_offset, alignment, source)
    return GGUFFile(path, version, fields, tensors, alignment, data_offset)


def _check_tensors(infos, buf, size: int, data_offset: int, alignment: int, source: str) -> list[GGUFTensor]:
    tensors, seen = [], set()
    for name, shape, raw_type, offset in infos:
        what = f"{source}: not a readable GGUF file: tensor {name!r}"
        if name in seen:
            raise GGUFError(f"{what}: expected each tensor name once, found a duplicate")
        seen.add(name)
        try:
            ttype = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{what}: expected a known ggml type, found type id {raw_type}") from None
        if ttype not in gguf.GGML_QUANT_SIZES:
            raise GGUFError(f"{what}: expected a ggml type with a known block size, found {ttype.name}")
        block, type_size = gguf.GGML_QUANT_SIZES[ttype]
        if shape[0] % block:
            raise GGUFError(f"{what}: expected a row length (ne[0]) that is a multiple of the {ttype.name} block "
                            f"size {block}, found {shape[0]}")
        nbytes = math.prod(shape) // block * type_size  # Python ints: a 2^60-element claim is just a big number
        if offset % alignment:
            raise GGUFError(f"{what}: expected a data offset that is a multiple of the alignment {alignment}, "
                            f"found {offset}")
        begin = data_offset + offset
        if begin + nbytes > size:
            raise GGUFError(f"{what}: shape {list(shape)} {ttype.name} needs {nbytes} bytes at byte {begin}, "
                            f"expected to end within the file's {size} bytes, found it ends at byte {begin + nbytes} "
                            "(file truncated or a corrupt shape / offset)")
        tensors.append(GGUFTensor(name, ttype, shape, begin, nbytes, buf))
    by_begin = sorted(tensors, key=lambda t: (t.begin, t.nbytes))
    for a, b in zip(by_begin, by_begin[1:]):
        if b.begin < a.begin + a.nbytes:
            raise GGUFError(f"{source}: not a readable GGUF file: tensor {b.name!r} starts at byte {b.begin}, "
                            f"inside tensor {a.name!r} (bytes {a.begin}..{a.begin + a.nbytes}): expected tensors not to overlap")
    return tensors


__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "read_gguf"]
