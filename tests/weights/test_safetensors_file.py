"""The safetensors reader/writer (over the `safetensors` package's numpy API): exact round trips for every dtype
(bf16 and fp8 included), byte compatibility with the package's other frameworks in both directions, atomic writes,
and errors that name the file and the tensor for truncated and corrupt files."""
from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from surojax.weights.atomic import write_text_atomic
from surojax.weights.safetensors_file import DTYPES, SafetensorsFile, WeightsError, write_safetensors


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    return {
        "f32": x,
        "f64": x.astype(np.float64),
        "f16": x.astype(np.float16),
        "bf16": x.astype(ml_dtypes.bfloat16),
        "f8e4m3": x.astype(ml_dtypes.float8_e4m3fn),
        "f8e5m2": x.astype(ml_dtypes.float8_e5m2),
        "i64": np.arange(7, dtype=np.int64) - 3,
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "i16": np.array([-2, 5], np.int16),
        "i8": np.array([-128, 127], np.int8),
        "u8": np.array([0, 255, 7], np.uint8),
        "u16": np.array([0, 65535], np.uint16),
        "u32": np.array([1, 2**32 - 1], np.uint32),
        "u64": np.array([3, 2**64 - 1], np.uint64),
        "bool": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "transposed": x.T,  # not C-contiguous: written as its logical (transposed) layout
    }


def test_round_trip_every_dtype_bit_exact(tmp_path):
    tensors = sample_tensors()
    assert {str(t.dtype) for t in tensors.values()} >= {str(d) for d in DTYPES.values()}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt", "note": "hi"})
    f = SafetensorsFile(path)
    assert sorted(f.names()) == sorted(tensors)  # names() is in file order, which the writer chooses
    assert f.metadata == {"format": "pt", "note": "hi"}
    for name, ref in tensors.items():
        got = f.get(name)
        assert f.shape(name) == ref.shape and f.dtype(name) == ref.dtype and got.dtype == ref.dtype, name
        assert got.tobytes() == np.ascontiguousarray(ref).tobytes(), name
    got = f.get("f32")
    got[0, 0] = 1e9  # a copy: changing it changes neither the file nor a later read
    assert f.get("f32")[0, 0] == tensors["f32"][0, 0]
    assert SafetensorsFile(path).get("f32").tobytes() == tensors["f32"].tobytes()


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    from surojax.weights import safetensors_file

    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"old": np.ones(2, np.float32)})

    def boom(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_file, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_safetensors(path, {"new": np.zeros(2, np.float32)})
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]
    assert SafetensorsFile(path).names() == ["old"]


def test_header_is_aligned_and_default_metadata(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": np.ones(3, np.float32)})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and len(raw) == 8 + n + 12
    assert json.loads(raw[8:8 + n])["__metadata__"] == {"format": "pt"}


def test_files_we_write_are_read_by_the_safetensors_library(tmp_path):
    safetensors_flax = pytest.importorskip("safetensors.flax")
    from safetensors import safe_open

    tensors = {k: v for k, v in sample_tensors().items() if not k.startswith("f8")}
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, tensors)
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        for name in ("f32", "f16", "i64", "u8", "bool", "scalar", "empty", "transposed"):
            got = f.get_tensor(name)
            assert got.shape == tensors[name].shape and got.dtype == tensors[name].dtype, name
            np.testing.assert_array_equal(got, tensors[name])
    got = safetensors_flax.load_file(str(path))  # bf16 through jax
    assert got["bf16"].dtype == tensors["bf16"].dtype
    assert np.asarray(got["bf16"]).tobytes() == tensors["bf16"].tobytes()


def test_we_read_files_written_by_the_safetensors_library(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_flax = pytest.importorskip("safetensors.flax")
    import jax.numpy as jnp

    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.array([1, 2], np.int64)}
    safetensors_numpy.save_file(tensors, str(tmp_path / "np.safetensors"), metadata={"format": "np"})
    f = SafetensorsFile(tmp_path / "np.safetensors")
    assert f.metadata == {"format": "np"}
    for name, ref in tensors.items():
        np.testing.assert_array_equal(f.get(name), ref)
        assert f.get(name).dtype == ref.dtype
    bf = jnp.linspace(-2, 2, 10, dtype=jnp.bfloat16)
    safetensors_flax.save_file({"bf": bf}, str(tmp_path / "bf.safetensors"))
    g = SafetensorsFile(tmp_path / "bf.safetensors")
    assert g.dtype("bf") == ml_dtypes.bfloat16 and g.get("bf").tobytes() == np.asarray(bf).tobytes()


# ---- errors ------------------------------------------------------------------------------------------------------

@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"first": np.ones((4, 4), np.float32), "last.weight": np.ones((8, 2), np.float32)})
    return path


def error(path) -> str:
    with pytest.raises(WeightsError) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)  # every message names the file
    return str(e.value)


def test_missing_file(tmp_path):
    assert "file not found" in error(tmp_path / "nope.safetensors")


def test_truncated_in_the_data_names_the_tensor_and_sizes(good_file):
    raw = good_file.read_bytes()
    good_file.write_bytes(raw[:-10])
    msg = error(good_file)
    assert "truncated" in msg and "'last.weight'" in msg
    assert f"ends at byte {len(raw)}" in msg and f"file has {len(raw) - 10} bytes" in msg


def test_truncated_in_the_header(good_file):
    raw = good_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    good_file.write_bytes(raw[:8 + n // 2])
    msg = error(good_file)
    assert "truncated" in msg and f"header says {n} bytes" in msg and f"file has {8 + n // 2}" in msg
    good_file.write_bytes(raw[:5])
    assert "only 5 bytes" in error(good_file)
    good_file.write_bytes(b"")
    assert "only 0 bytes" in error(good_file)


def test_garbage_bytes(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(np.random.default_rng(1).bytes(4096))
    assert "corrupt or truncated safetensors header" in error(path)
    path.write_bytes(b"<html>404 Not Found</html>")  # what a failed download often leaves
    assert "corrupt or truncated safetensors header" in error(path)


def header_file(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_corrupt_json_header(tmp_path):
    path = tmp_path / "bad.safetensors"
    assert "corrupt safetensors header" in error(header_file(path, b'{"a": {"dtype": "F32", "sha'))
    assert "corrupt safetensors header" in error(header_file(path, b"\xff\xfe garbage \x00"))
    assert "not a JSON object" in error(header_file(path, b"[1, 2, 3]"))


def test_malformed_entries_name_the_tensor(tmp_path):
    path = tmp_path / "bad.safetensors"
    msg = error(header_file(path, json.dumps({"w.weight": {"shape": [2], "data_offsets": [0, 8]}}).encode(), b"x" * 8))
    assert "'w.weight'" in msg and "malformed header entry" in msg
    msg = error(header_file(path, json.dumps({"w.weight": 7}).encode()))
    assert "'w.weight'" in msg and "malformed" in msg
    msg = error(header_file(
        path, json.dumps({"q": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode(), b"x"))
    assert "'q'" in msg and "dtype F4" in msg and "BF16" in msg  # the supported dtypes are listed
    msg = error(header_file(
        path, json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}).encode(), b"x" * 16))
    assert "'w'" in msg and "inconsistent" in msg and "[2, 3] F32 vs 16 bytes" in msg


def test_unwritable_dtype_names_the_tensor(tmp_path):
    with pytest.raises(WeightsError, match="'c'.*complex64"):
        write_safetensors(tmp_path / "x.safetensors", {"ok": np.ones(2, np.float32), "c": np.ones(2, np.complex64)})


def test_absurd_shape_and_trailing_bytes(tmp_path):
    path = tmp_path / "bad.safetensors"
    msg = error(header_file(
        path, json.dumps({"w": {"dtype": "F32", "shape": [2**30, 2**30], "data_offsets": [0, 8]}}).encode(), b"x" * 8))
    assert "'w'" in msg and "inconsistent" in msg and "vs 8 bytes" in msg  # a 2^60-element claim, nothing allocated
    msg = error(header_file(
        path, json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(), b"x" * 12))
    assert "not a valid safetensors file" in msg and "not fully covered" in msg  # the package's reason, kept


def test_written_files_get_the_usual_new_file_mode(tmp_path):
    """Not the 0600 of safetensors' own temporary file: 0666 & ~umask, as any file the user writes, also when the
    file replaces an older one (atomic_path / AtomicFile, weights/atomic.py)."""
    old = os.umask(0o027)
    try:
        path = tmp_path / "t.safetensors"
        write_safetensors(path, {"a": np.ones(2, np.float32)})
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        path.chmod(0o600)
        write_safetensors(path, {"b": np.ones(2, np.float32)})
        write_text_atomic(tmp_path / "c.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and SafetensorsFile(path).names() == ["b"]
    assert stat.S_IMODE((tmp_path / "c.json").stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "t.safetensors"]  # no temporary file left
