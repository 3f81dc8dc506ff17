"""Readers that survive anything: truncated, bit-flipped and hand-crafted malformed GGUF / safetensors / JSON files.

Every case must end in the reader family's named error (GGUFError, SafetensorsError, TokenizerError, AdapterError,
ModelRefError, WeightsError: ValueError subclasses with is_user_error = True) whose message names the file; no
other exception type, no hang, and nothing allocated beyond the file's size. Deterministic (seeded) and small.
"""
from __future__ import annotations

import json
import re
import shutil
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from surojax.data.tokenizer import Tokenizer, TokenizerError
from surojax.peft.peft_io import AdapterError, read_adapter_config
from surojax.weights.gguf_checkpoint import _dequantize, load_gguf_tokenizer, read_gguf_hf_config
from surojax.weights.gguf_reader import GGUFError, read_gguf
from surojax.weights.hf_checkpoint import read_config
from surojax.weights.model_ref import ModelRefError, adapter_base_name
from surojax.weights.safetensors_file import SafetensorsError, SafetensorsFile, WeightsError, write_safetensors

REPO = Path(__file__).parents[2]
TOKENIZER_DIR = REPO / "tests" / "fixtures" / "tokenizer"
N_FLIPS = 300


def _survives(fn, path, error: type[Exception]):
    """fn(path) either returns or raises `error` naming the file (any other exception fails the test)."""
    try:
        return fn(path)
    except error as e:
        assert e.is_user_error is True and isinstance(e, ValueError)
        assert str(path) in str(e), str(e)
        return e


def _mutants(tmp_path: Path, suffix: str, mutants):
    """(path, bytes) for each mutant, each in a fresh file (rewriting one file in place is slow on some file
    systems) removed after its turn."""
    for i, data in enumerate(mutants):
        path = tmp_path / f"m{i}{suffix}"
        path.write_bytes(data)
        yield path, data
        path.unlink()


def _flip(data: bytes, rng) -> bytes:
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 5))):
        out[int(rng.integers(len(out)))] ^= int(rng.integers(1, 256))
    return bytes(out)


# -- GGUF ---------------------------------------------------------------------------------------------------------
TOKENS = ["a", "b", "c", "d", "ab", "abc", "<|end|>", "Ġ"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    """A small valid qwen3 GGUF (GGUFWriter): metadata, a gpt2 tokenizer, F32 / F16 / Q8_0 tensors."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name("tiny")
    for fn, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 32),
                  (w.add_feed_forward_length, 32), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                  (w.add_key_length, 16), (w.add_vocab_size, len(TOKENS))):
        fn(v)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([1, 1, 1, 1, 1, 1, 3, 1])
    w.add_token_merges(["a b", "ab c"])
    w.add_eos_token_id(6)
    w.add_chat_template("{{ messages[0]['content'] }}")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(TOKENS), 32)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float16))
    q = gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _exercise_gguf(path: Path) -> None:
    """Everything a loader does short of building the model: parse, touch and decode every tensor, derive the
    config, rebuild the tokenizer."""
    gf = _survives(read_gguf, path, GGUFError)
    if isinstance(gf, GGUFError):
        return
    for t in gf.tensors:
        np.asarray(t.data).sum()
        _survives(lambda p, t=t: _dequantize(t, str(p)), path, GGUFError)
    _survives(read_gguf_hf_config, path, GGUFError)
    _survives(load_gguf_tokenizer, path, GGUFError)


def test_gguf_valid_fixture_reads_as_gguf_reader_does(tiny_gguf, tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(tiny_gguf)
    ours, ref = read_gguf(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist()
        np.testing.assert_array_equal(a.data, b.data)
        assert a.data.dtype == b.data.dtype
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == pytest.approx(field.contents()), key
    assert read_gguf_hf_config(path)["hidden_size"] == 32
    assert load_gguf_tokenizer(path).encode("abc") == [5]


def test_gguf_truncated_at_every_offset(tiny_gguf, tmp_path):
    end = max(t.begin + t.nbytes for t in read_gguf_bytes(tiny_gguf, tmp_path).tensors)
    for path, data in _mutants(tmp_path, ".gguf", (tiny_gguf[:n] for n in range(len(tiny_gguf)))):
        if len(data) < end:  # header or tensor data cut: always refused, by name
            with pytest.raises(GGUFError, match=re.escape(str(path))):
                read_gguf(path)
        else:  # only trailing padding cut: still a complete file
            _exercise_gguf(path)


def read_gguf_bytes(data: bytes, tmp_path: Path):
    p = tmp_path / "whole.gguf"
    p.write_bytes(data)
    return read_gguf(p)


def test_gguf_random_byte_flips(tiny_gguf, tmp_path):
    rng = np.random.default_rng(14)
    for path, _ in _mutants(tmp_path, ".gguf", (_flip(tiny_gguf, rng) for _ in range(N_FLIPS))):
        _exercise_gguf(path)


# A GGUF written by hand, so that every field can be made absurd.
def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _tinfo(name, dims, ttype=0, offset=0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype,
                                                                                                           offset)


def _gguf_file(kvs=(), tensors=(), data=b"", n_kv=None, n_tensors=None, version=3, align=32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % align) + data


F32_8 = _tinfo("w", [8], 0, 0)  # an F32 tensor of 8 values at offset 0
ABSURD = {  # name -> (file bytes, what the message must say)
    "tensor count": (_gguf_file(n_tensors=2**63), r"tensor count: expected at most \d+ .*found 9223372036854775808"),
    "kv count": (_gguf_file(n_kv=2**62), r"metadata key count: expected at most \d+ .*found 4611686018427387904"),
    "key length": (_gguf_file([struct.pack("<Q", 2**60) + b"k"]), r"metadata key #0: expected a string of at most"),
    "string length": (_gguf_file([_kv("general.name", 8, struct.pack("<Q", 2**61) + b"x")]),
                      r"'general.name': expected a string of at most \d+ bytes.*found a length of 2305843009213693952"),
    "array length": (_gguf_file([_kv("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, 2**60) + b"\0" * 8)]),
                     r"'tokenizer.ggml.token_type': expected at most \d+ int32 items.*found an array length of"),
    "string array length": (_gguf_file([_kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**59))]),
                            r"'tokenizer.ggml.tokens': expected at most \d+ strings"),
    "2^60 elements": (_gguf_file(tensors=[_tinfo("huge", [2**30, 2**30], 0, 0)], data=b"\0" * 64),
                      r"tensor 'huge': shape \[1073741824, 1073741824\] F32 needs 4611686018427387904 bytes"),
    "dims count": (_gguf_file(tensors=[_tinfo("w", [1] * 5)]), r"tensor 'w' dimension count: expected 1 to 4, found 5"),
    "offset past the end": (_gguf_file(tensors=[_tinfo("w", [8], 0, 2**40)], data=b"\0" * 32),
                            r"tensor 'w': .*expected to end within the file's \d+ bytes"),
    "misaligned offset": (_gguf_file(tensors=[_tinfo("w", [8], 0, 4)], data=b"\0" * 64),
                          r"tensor 'w': expected a data offset that is a multiple of the alignment 32, found 4"),
    "row not whole blocks": (_gguf_file(tensors=[_tinfo("q", [33, 2], 8, 0)], data=b"\0" * 96),
                             r"tensor 'q': expected a row length .* multiple of the Q8_0 block size 32, found 33"),
    "duplicate key": (_gguf_file([_kv("a", 4, b"\1\0\0\0")] * 2), r"metadata key 'a': expected each key once"),
    "duplicate tensor": (_gguf_file(tensors=[F32_8, F32_8], data=b"\0" * 32), r"tensor 'w': expected each tensor"),
    "alignment": (_gguf_file([_kv("general.alignment", 4, struct.pack("<I", 3))], align=3),
                  r"'general.alignment': expected a power of two, found 3"),
    "version": (_gguf_file(version=1), r"version: expected one of \(2, 3\), found 1"),
    "big-endian": (_gguf_file(version=3 << 24), r"version: .*found 50331648 \(a big-endian file\?\)"),
    "magic": (b"GGUL" + _gguf_file()[4:], r"magic: expected b'GGUF', found b'GGUL'"),
}


def refused_within(path, read, error, message: str) -> int:
    """`read(path)` raises `error` naming the file and matching `message`; returns the peak traced allocation."""
    tracemalloc.start()
    try:
        with pytest.raises(error, match=re.escape(str(path)) + ".*" + message):
            read(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("case", ABSURD)
def test_gguf_absurd_counts_dims_and_offsets_are_refused_before_allocating(case, tmp_path):
    data, message = ABSURD[case]
    path = tmp_path / "absurd.gguf"
    path.write_bytes(data)
    peak = refused_within(path, read_gguf, GGUFError, message)
    assert peak < 256 * 1024, peak  # a few small objects: nothing sized by the claimed counts


def test_gguf_wrong_and_unknown_types(tmp_path):
    path = tmp_path / "types.gguf"
    cases = [
        (_gguf_file(tensors=[_tinfo("w", [8], 4)], data=b"\0" * 32), r"tensor 'w': expected a known ggml type, found "
                                                                       r"type id 4"),
        (_gguf_file(tensors=[_tinfo("w", [8], 999)], data=b"\0" * 32), r"tensor 'w': .*found type id 999"),
        (_gguf_file([_kv("k", 13, b"\0" * 8)]), r"metadata key 'k': expected a value type among .*found type 13"),
        (_gguf_file([_kv("k", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0))]),
         r"metadata key 'k' \(array item type\): .*found type 9 \(nested arrays are not supported\)"),
    ]
    for data, message in cases:
        path.write_bytes(data)
        with pytest.raises(GGUFError, match=re.escape(str(path)) + ".*" + message):
            read_gguf(path)
    # well-formed values of the wrong type for what the loaders need
    arch = _kv("general.architecture", 8, _s("qwen3"))
    ints = [_kv(f"qwen3.{k}", 4, struct.pack("<I", 2)) for k in ("attention.head_count", "embedding_length",
                                                                 "feed_forward_length", "vocab_size")]
    path.write_bytes(_gguf_file([arch, *ints, _kv("qwen3.block_count", 8, _s("two"))]))
    with pytest.raises(GGUFError, match=r"qwen3.block_count: expected a non-negative integer, found str 'two'"):
        read_gguf_hf_config(path)
    path.write_bytes(_gguf_file([arch, *ints, _kv("qwen3.block_count", 4, struct.pack("<I", 10**6))]))
    with pytest.raises(GGUFError, match=r"qwen3.block_count: expected at most the file's 0 tensors, found 1000000"):
        read_gguf_hf_config(path)
    path.write_bytes(_gguf_file([_kv("tokenizer.ggml.model", 8, _s("gpt2")),
                                 _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 4, 2) + b"\0" * 8)]))
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.tokens: expected a list of str, found an item of type int"):
        load_gguf_tokenizer(path)


def test_gguf_non_utf8_strings(tmp_path):
    path = tmp_path / "utf8.gguf"
    bad = b"caf\xe9"
    cases = [(_gguf_file([_kv(bad, 4, b"\0" * 4)]), r"metadata key #0: expected a UTF-8 string, found invalid byte "
                                                    r"0xe9 at string offset 3"),
             (_gguf_file([_kv("general.name", 8, _s(bad))]), r"metadata key 'general.name': expected a UTF-8 string"),
             (_gguf_file([_kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + _s("ok") + _s(bad))]),
              r"metadata key 'tokenizer.ggml.tokens'\[1\]: expected a UTF-8 string"),
             (_gguf_file(tensors=[_tinfo(bad, [8])], data=b"\0" * 32), r"tensor #0 name: expected a UTF-8 string")]
    for data, message in cases:
        path.write_bytes(data)
        with pytest.raises(GGUFError, match=re.escape(str(path)) + ".*" + message):
            read_gguf(path)


def test_gguf_overlapping_tensors(tmp_path):
    path = tmp_path / "overlap.gguf"
    path.write_bytes(_gguf_file(tensors=[_tinfo("a", [16], 0, 0), _tinfo("b", [8], 0, 64)], data=b"\0" * 96))
    read_gguf(path)  # adjacent: fine
    path.write_bytes(_gguf_file(tensors=[_tinfo("a", [16], 0, 0), _tinfo("b", [8], 0, 64), _tinfo("c", [8], 0, 32)],
                                data=b"\0" * 96))
    with pytest.raises(GGUFError, match=re.escape(str(path)) + r".*tensor 'c' starts at byte \d+, inside tensor 'a' "
                                        r"\(bytes \d+\.\.\d+\): expected tensors not to overlap"):
        read_gguf(path)


# -- safetensors --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_safetensors(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("st") / "tiny.safetensors"
    rng = np.random.default_rng(0)
    write_safetensors(path, {"a": rng.standard_normal((3, 4)).astype(np.float32),
                             "b": np.arange(6, dtype=np.int32), "c": np.ones(5, np.float16)})
    return path.read_bytes()


def _exercise_safetensors(path: Path) -> None:
    f = _survives(SafetensorsFile, path, SafetensorsError)
    if not isinstance(f, SafetensorsError):
        for name in f.names():
            assert f.get(name).shape == f.shape(name)


def test_safetensors_truncated_at_every_offset(tiny_safetensors, tmp_path):
    for path, _ in _mutants(tmp_path, ".safetensors", (tiny_safetensors[:n] for n in range(len(tiny_safetensors)))):
        with pytest.raises(SafetensorsError, match=re.escape(str(path))):
            SafetensorsFile(path)


def test_safetensors_random_byte_flips(tiny_safetensors, tmp_path):
    rng = np.random.default_rng(14)
    for path, _ in _mutants(tmp_path, ".safetensors", (_flip(tiny_safetensors, rng) for _ in range(N_FLIPS))):
        _exercise_safetensors(path)


def _st_file(header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


ST_CASES = {
    "header length": (_st_file({}, header_len=2**60), r"header says 1152921504606846976 bytes, file has 10"),
    "2^60 elements": (_st_file({"t": {"dtype": "F32", "shape": [2**30, 2**30], "data_offsets": [0, 16]}}, b"\0" * 16),
                      r"tensor 't' header is inconsistent \(shape \[1073741824, 1073741824\] F32 vs 16 bytes\)"),
    "offset past the end": (_st_file({"t": {"dtype": "F32", "shape": [4], "data_offsets": [2**40, 2**40 + 16]}},
                                     b"\0" * 16), r"tensor 't' ends at byte \d+ but the file has \d+ bytes"),
    "unknown dtype": (_st_file({"t": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2),
                      r"(tensor 't' has dtype F4|not a valid safetensors file)"),
    "overlap": (_st_file({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "u": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16),
                r"not a valid safetensors file"),
    "non-utf8 header": (_st_file(b'{"t\xe9": 1}'), r"corrupt safetensors header"),
    "not an object": (_st_file(b"[1, 2]"), r"(not a JSON object|not a valid safetensors file)"),
    "deep nesting": (_st_file(b"[" * 100_000), r"(corrupt safetensors header|not a valid safetensors file)"),
}


@pytest.mark.parametrize("case", ST_CASES)
def test_safetensors_absurd_fields_are_refused(case, tmp_path):
    data, message = ST_CASES[case]
    path = tmp_path / "absurd.safetensors"
    path.write_bytes(data)
    peak = refused_within(path, SafetensorsFile, SafetensorsError, message)
    assert peak < 4 * len(data) + 256 * 1024, peak


# -- JSON configs and the tokenizer folder -------------------------------------------------------------------------
JSON_READERS = {  # file name -> (reader of the folder, its named error)
    "config.json": (read_config, WeightsError),
    "adapter_config.json": (read_adapter_config, AdapterError),
    "adapter_config.json via model_ref": (adapter_base_name, ModelRefError),
    "tokenizer_config.json": (Tokenizer.from_dir, TokenizerError),
    "tokenizer.json": (Tokenizer.from_dir, TokenizerError),
}


def _json_folder(tmp_path: Path, which: str) -> tuple[Path, Path]:
    d = tmp_path / "folder"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(TOKENIZER_DIR, d)
    cfg = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "tie_word_embeddings": True, "hidden_act": "silu"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"], "base_model_name_or_path": "b"}))
    return d, d / which.split(" ")[0]


@pytest.mark.parametrize("which", JSON_READERS)
def test_json_configs_truncated_flipped_and_malformed(which, tmp_path):
    reader, error = JSON_READERS[which]
    d, target = _json_folder(tmp_path, which)
    reader(d)  # the untouched folder loads
    original = target.read_bytes()
    rng = np.random.default_rng(14)
    cuts = sorted(set(range(0, len(original), max(1, len(original) // 60))))
    mutants = [original[:n] for n in cuts] + [_flip(original, rng) for _ in range(60)]
    mutants += [b"\xff\xfe" + original, b"[" * 100_000, b"[1, 2]", b'"text"', b"null"]
    for data in mutants:
        target.write_bytes(data)
        e = _survives(reader, d, error)
        if isinstance(e, error):
            assert target.name in str(e) or str(d) in str(e), str(e)


# -- nothing unpickles ---------------------------------------------------------------------------------------------
def test_no_code_path_unpickles():
    """No module imports pickle-based loaders; np.load (if ever used) must pass allow_pickle=False."""
    banned = re.compile(r"\bimport (c?pickle|joblib|dill|cloudpickle)\b|\bfrom (c?pickle|joblib|dill) import|"
                        r"torch\.load\(|pickle\.loads?\(|allow_pickle\s*=\s*True|pd\.read_pickle|\.read_pickle\(")
    offenders, np_loads = [], []
    for path in sorted((REPO / "surojax").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for i, line in enumerate(text.splitlines(), 1):
            if banned.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
            if re.search(r"\b(np|numpy)\.load\(", line) and "allow_pickle=False" not in line:
                np_loads.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, offenders
    assert not np_loads, f"np.load without allow_pickle=False: {np_loads}"
