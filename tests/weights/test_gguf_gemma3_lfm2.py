"""Gemma 3 (gemma3_text / gemma3) as llama.cpp's `gemma3` GGUF and LFM2 (lfm2) as `lfm2`, against llama.cpp's own
converter (tests/fixtures/gguf/gemma3_converter.json, lfm2_converter.json, made by
scripts/make_gemma3_lfm2_gguf_fixtures.py with the convert_hf_to_gguf.py and gguf-py that llama-cpp-python 0.3.36
vendors) and llama.cpp's logits:

- for the HF folders gemma3_gguf (f32, f16, q8_0), lfm2_gguf (f32, f16, q8_0: ffn_down's rows of 112 values fall
  back to F16) and lfm2 (f32), our file has the converter's metadata (general.* / tokenizer.* aside) and its
  tensors: the same names, types, shapes and bytes ((1 + w) norms written 1 + w; the conv [D, K] and F32);
- read back, the f32 file gives the HF model's weights and logits; q8_0 Linears stay quantised;
- a Gemma 3 whose layer pattern is not llama.cpp's default (gemma3_text, and gemma3's text backbone, with their
  query_pre_attn_scalar set to llama.cpp's) gets attention.sliding_window_pattern and reads back with its layer
  types and logits;
- llama.cpp's logits on the converter's f32 files match ours on our files;
- what llama.cpp cannot run is refused by name: another query_pre_attn_scalar, conv_bias, a K-quant mix.
"""
import hashlib
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tests.weights.gguf_tiny import PROMPT_IDS  # noqa: E402
from tests.weights.test_gguf_qwen35 import _byte_tokenizer, _logits  # noqa: E402

from surojax.quant.model import is_quantized  # noqa: E402
from surojax.weights.gguf_checkpoint import load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.hf_checkpoint import hf_tensors, load_model  # noqa: E402
from surojax.weights.safetensors_file import WeightsError  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
MODELS = FIXTURES / "models"
ARCHS = ("gemma3", "lfm2")
REF = {case: ref for arch in ARCHS
       for case, ref in json.loads((FIXTURES / "gguf" / f"{arch}_converter.json").read_text()).items()}
CASES = sorted(REF)
RUNNABLE = {"gemma3": "gemma3_gguf", "lfm2": "lfm2_gguf"}  # llama.cpp runs these (vocab 512, the tokenizer)
# |ours - llama.cpp| on the 16-token prompt: llama.cpp's CPU GELU reads an f16 table (transformers' logits differ
# from llama.cpp's by 1.4e-3 on gemma3_gguf); lfm2 has no GELU (2e-6 from transformers' when made)
LLAMA_CPP_TOL = {"gemma3": 3e-3, "lfm2": 1e-4}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """"<folder>-<file type>" -> our .gguf of that HF fixture folder."""
    root = tmp_path_factory.mktemp("gemma3_lfm2")
    byte_tok = _byte_tokenizer(root / "bytes")
    out = {}
    for case in CASES:
        folder, ft = case.rsplit("-", 1)
        tok = MODELS / folder if (MODELS / folder / "tokenizer.json").is_file() else byte_tok
        out[case] = save_gguf(MODELS / folder, root / f"{case}.gguf", ft, tokenizer_dir=tok)
    return out


def _metadata(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith(("general.", "tokenizer.", "GGUF."))}


def check_converter_file(path, ref: dict, ignore_keys=()) -> None:
    """Our file against the converter's record (tests/fixtures/gguf/<arch>_converter.json, one case): the metadata
    (general.* / tokenizer.* and `ignore_keys` aside) and every tensor's name, type, shape and bytes."""
    meta = {k: v for k, v in _metadata(path).items() if k not in ignore_keys}
    assert meta == ref["metadata"]
    ours = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert sorted(ours) == sorted(ref["tensors"])
    for name, (typ, shape, digest) in ref["tensors"].items():
        t = ours[name]
        assert [t.tensor_type.name, [int(n) for n in t.shape]] == [typ, shape], name
        assert hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest() == digest, name


@pytest.mark.parametrize("case", CASES)
def test_file_equals_the_converters(files, case):
    # the gemma3 converter leaves gemma3.vocab_size to the tokens
    check_converter_file(files[case], REF[case], ignore_keys=("gemma3.vocab_size",))


def _check_round_trip(hf, model, cfg, prefix=None):
    ours, ref = hf_tensors(model), hf_tensors(hf)
    assert len(ours) == len(ref)
    for name, value in ours.items():
        want = ref[name.replace("model.", prefix, 1) if prefix and name.startswith("model.") else name]
        np.testing.assert_array_equal(np.asarray(value) + 1, np.asarray(want) + 1, err_msg=name)
    ids = [i % hf.cfg.vocab_size for i in PROMPT_IDS]
    np.testing.assert_allclose(_logits(model, ids), _logits(hf, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("folder", ["gemma3_gguf", "lfm2_gguf", "lfm2"])
def test_f32_round_trip_gives_the_hf_logits(files, folder):
    """Every weight read back equals the checkpoint's, the config its layer kinds, and the logits transformers'
    (expected.npz where the folder has it, else the HF folder loaded by surojax)."""
    hf = load_model(MODELS / folder, dtype=jnp.float32)
    cfg, model, _ = load_gguf_model(files[f"{folder}-f32"], dtype=jnp.float32)
    assert cfg.model_type == ("gemma3_text" if folder.startswith("gemma3") else "lfm2")
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [
        hf.cfg.layer_window(i) for i in range(hf.cfg.num_layers)]
    assert np.float32(cfg.rms_norm_eps) == np.float32(hf.cfg.rms_norm_eps)  # a float32 in the file
    assert (cfg.short_conv, cfg.intermediate_size, cfg.rope_theta, cfg.rope_scaling, cfg.local_rope_theta,
            cfg.query_pre_attn_scalar) == (hf.cfg.short_conv, hf.cfg.intermediate_size, hf.cfg.rope_theta,
                                          hf.cfg.rope_scaling, hf.cfg.local_rope_theta, hf.cfg.query_pre_attn_scalar)
    _check_round_trip(hf, model, cfg)
    expected = MODELS / folder / "expected.npz"
    if expected.is_file():
        exp = np.load(expected)
        np.testing.assert_allclose(_logits(model, list(exp["tokens2"])), exp["logits2"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("folder", ["gemma3_text", "gemma3"])
def test_gemma3_pattern_beyond_llama_cpps_default(tmp_path, folder):
    """The fixtures' [sliding, sliding, full, sliding, sliding] is not llama.cpp's every-6th-layer default: the file
    says which layers slide; the multimodal checkpoint's text backbone reads back as gemma3_text."""
    src = tmp_path / folder
    shutil.copytree(MODELS / folder, src)
    config = json.loads((src / "config.json").read_text())
    (config.get("text_config") or config)["query_pre_attn_scalar"] = 16  # llama.cpp's (head_dim)
    (src / "config.json").write_text(json.dumps(config))
    path = save_gguf(src, tmp_path / "m.gguf", "f32", tokenizer_dir=_byte_tokenizer(tmp_path / "bytes"))
    assert _metadata(path)["gemma3.attention.sliding_window_pattern"] == [True, True, False, True, True]
    hf = load_model(src, dtype=jnp.float32)
    cfg, model, _ = load_gguf_model(path, dtype=jnp.float32)
    assert cfg.model_type == "gemma3_text"
    assert cfg.layer_windows == hf.cfg.layer_windows == (4, 4, None, 4, 4)
    _check_round_trip(hf, model, cfg, prefix="model.language_model." if folder == "gemma3" else None)


def test_q8_0_read_back(files):
    for folder in ("gemma3_gguf", "lfm2_gguf"):
        _, kept, _ = load_gguf_model(files[f"{folder}-q8_0"], dtype=jnp.float32)
        _, deq, _ = load_gguf_model(files[f"{folder}-q8_0"], dtype=jnp.float32, keep_quantized=False)
        q = is_quantized(kept)
        assert q["q_proj"] == q["gate_proj"] == "q8_0" and not is_quantized(deq), q
        if folder == "lfm2_gguf":
            assert q["conv_layers.conv.in_proj"] == q["conv_layers.conv.out_proj"] == "q8_0", q
            assert not {"down_proj", "conv_layers.down_proj"} & set(q)  # F16 in the file (rows of 112): dequantised
        np.testing.assert_allclose(_logits(kept), _logits(deq), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", [
    pytest.param(arch, marks=pytest.mark.skipif(not (FIXTURES / "gguf" / f"logits_{arch}_f32.npy").is_file(),
                                                reason="llama.cpp's logits were not made (llama-cpp-python missing)"))
    for arch in ARCHS])
def test_logits_match_llama_cpp(files, arch):
    _, model, _ = load_gguf_model(files[f"{RUNNABLE[arch]}-f32"], dtype=jnp.float32)
    ref = np.load(FIXTURES / "gguf" / f"logits_{arch}_f32.npy")
    assert np.abs(_logits(model) - ref).max() < LLAMA_CPP_TOL[arch]


def test_what_llama_cpp_cannot_run_is_refused(tmp_path):
    with pytest.raises(WeightsError, match=r"gemma3 query_pre_attn_scalar 24 cannot be written.*1/sqrt\(16\)"):
        save_gguf(MODELS / "gemma3_text", tmp_path / "x.gguf", "f32", tokenizer_dir=MODELS / "gemma3_gguf")
    with pytest.raises(WeightsError, match=r"lfm2 with conv_bias true cannot be written to GGUF"):
        save_gguf(MODELS / "lfm2_conv_bias", tmp_path / "x.gguf", "f32", tokenizer_dir=MODELS / "lfm2_gguf")
    for folder in ("gemma3_gguf", "lfm2_gguf"):
        with pytest.raises(WeightsError, match=r"is written to GGUF as f32, f16, bf16, q8_0.*'q4_k_m'"):
            save_gguf(MODELS / folder, tmp_path / "x.gguf", "q4_k_m")
    assert not (tmp_path / "x.gguf").exists()
