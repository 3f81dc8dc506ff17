"""Gemma 4 (gemma4_text / gemma4) as llama.cpp's `gemma4` GGUF, against llama.cpp's own converter
(tests/fixtures/gguf/gemma4_converter.json, made by scripts/make_gemma4_gguf_fixtures.py with the convert_hf_to_gguf.py
and gguf-py that llama-cpp-python 0.3.36 vendors) and llama.cpp's logits:

- for the HF folder gemma4_gguf (per-layer inputs, KV-shared layers with the double-wide MLP, full layers of their
  own shape with attention_k_eq_v, the MoE block, soft-capping; f32, f16, q8_0), our file has the converter's
  metadata (general.* / tokenizer.* aside) and its tensors: the same names, types, shapes and bytes (rope_freqs
  included);
- read back, the f32 file gives the HF model's weights, config and logits; q8_0 Linears stay quantised;
- gemma4's text backbone, its full layers of the sliding layers' shape (the converter asserts on that, llama.cpp runs
  it), round-trips too;
- llama.cpp's logits on the converter's f32 file match ours on our file;
- what llama.cpp cannot run is refused by name: KV-shared layers reading other layers than llama.cpp's fixed choice
  (gemma4_text_shared), a K-quant mix.
"""
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tests.weights.test_gguf_gemma3_lfm2 import _check_round_trip, check_converter_file  # noqa: E402
from tests.weights.test_gguf_qwen35 import _byte_tokenizer, _logits  # noqa: E402

from surojax.quant.model import is_quantized  # noqa: E402
from surojax.weights.gguf_checkpoint import load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.hf_checkpoint import hf_tensors, load_model  # noqa: E402
from surojax.weights.safetensors_file import WeightsError  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
MODELS = FIXTURES / "models"
FOLDER = "gemma4_gguf"
REF = json.loads((FIXTURES / "gguf" / "gemma4_converter.json").read_text())
CASES = sorted(REF)
LOGITS = FIXTURES / "gguf" / "logits_gemma4_f32.npy"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """"<folder>-<file type>" -> our .gguf of that HF fixture folder."""
    root = tmp_path_factory.mktemp("gemma4")
    return {case: save_gguf(MODELS / FOLDER, root / f"{case}.gguf", case.rsplit("-", 1)[1]) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_file_equals_the_converters(files, case):
    check_converter_file(files[case], REF[case])


def _same_config(cfg, ref):
    assert cfg.model_type == "gemma4_text"
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [ref.layer_window(i) for i in range(ref.num_layers)]
    assert np.float32(cfg.rms_norm_eps) == np.float32(ref.rms_norm_eps)  # a float32 in the file
    if ref.moe is not None:  # its router's input norm has the model's eps
        assert np.float32(cfg.moe.router_input_norm) == np.float32(ref.moe.router_input_norm)
        assert cfg.moe == dataclasses.replace(ref.moe, router_input_norm=cfg.moe.router_input_norm)
    else:
        assert cfg.moe is None
    for field in ("global_attention", "attention_k_eq_v", "per_layer_input_size", "per_layer_vocab_size",
                  "kv_shared_layers", "double_wide_mlp", "rope_theta", "rope_scaling", "local_rope_theta",
                  "local_rope_scaling", "final_logit_softcapping", "head_dim", "num_kv_heads", "intermediate_size"):
        assert getattr(cfg, field) == getattr(ref, field), field


def test_f32_round_trip_gives_the_hf_logits(files):
    hf = load_model(MODELS / FOLDER, dtype=jnp.float32)
    cfg, model, _ = load_gguf_model(files[f"{FOLDER}-f32"], dtype=jnp.float32)
    _same_config(cfg, hf.cfg)
    assert cfg.global_attention.k_eq_v and cfg.kv_shared_layers == 2 and cfg.per_layer_input_size == 8
    _check_round_trip(hf, model, cfg)


def test_text_backbone_round_trip(tmp_path):
    """gemma4's text backbone, its full layers of the sliding layers' shape (no per_layer_config: the converter
    asserts on such a config, llama.cpp runs it), reads back as gemma4_text with every weight and transformers' logits
    (expected.npz)."""
    path = save_gguf(MODELS / "gemma4", tmp_path / "m.gguf", "f32", tokenizer_dir=_byte_tokenizer(tmp_path / "b"))
    hf = load_model(MODELS / "gemma4", dtype=jnp.float32)
    cfg, model, _ = load_gguf_model(path, dtype=jnp.float32)
    _same_config(cfg, hf.cfg)
    ours, ref = hf_tensors(model), hf_tensors(hf)
    assert len(ours) == len(ref)
    for name, value in ours.items():
        np.testing.assert_array_equal(value, ref[name.replace("model.", "model.language_model.", 1)], err_msg=name)
    exp = np.load(MODELS / "gemma4" / "expected.npz")
    np.testing.assert_allclose(_logits(model, list(exp["tokens2"])), exp["logits2"], rtol=1e-4, atol=1e-4)


def test_q8_0_read_back(files):
    _, kept, _ = load_gguf_model(files[f"{FOLDER}-q8_0"], dtype=jnp.float32)
    _, deq, _ = load_gguf_model(files[f"{FOLDER}-q8_0"], dtype=jnp.float32, keep_quantized=False)
    q = is_quantized(kept)
    assert not is_quantized(deq)
    assert q["q_proj"] == q["gate_proj"] == "q8_0" and {v for k, v in q.items() if "experts" in k} == {"q8_0"}, q
    np.testing.assert_allclose(_logits(kept), _logits(deq), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not LOGITS.is_file(), reason="llama.cpp's logits were not made (llama-cpp-python missing)")
def test_logits_match_llama_cpp(files):
    _, model, _ = load_gguf_model(files[f"{FOLDER}-f32"], dtype=jnp.float32)
    # 1.6e-3 apart, as transformers' logits are: llama.cpp's CPU GELU reads an f16 table (transformers with its GELU
    # taken on f16-rounded inputs and outputs comes within 3e-5 of llama.cpp's, checked when the fixture was made)
    assert np.abs(_logits(model) - np.load(LOGITS)).max() < 3e-3


def test_what_llama_cpp_cannot_run_is_refused(tmp_path):
    tok = MODELS / FOLDER
    with pytest.raises(WeightsError, match=r"KV-shared layer 4 reads layer 3's keys / values, llama.cpp's gemma4 "
                                           r"graph would read layer 2's"):
        save_gguf(MODELS / "gemma4_text_shared", tmp_path / "x.gguf", "f32", tokenizer_dir=tok)
    with pytest.raises(WeightsError, match=r"is written to GGUF as f32, f16, bf16, q8_0.*'q4_k_m'"):
        save_gguf(MODELS / FOLDER, tmp_path / "x.gguf", "q4_k_m")
    assert not (tmp_path / "x.gguf").exists()
