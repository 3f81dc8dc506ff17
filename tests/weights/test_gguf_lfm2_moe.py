"""LFM2-MoE (lfm2_moe) as llama.cpp's `lfm2moe` GGUF, against llama.cpp's own converter
(tests/fixtures/gguf/lfm2moe_converter.json, made by scripts/make_lfm2_moe_gguf_fixtures.py with the
convert_hf_to_gguf.py and gguf-py that llama-cpp-python 0.3.36 vendors) and llama.cpp's logits:

- for the HF folder lfm2_moe_gguf (f32, f16, q8_0: the dense layer's ffn_down rows of 48 values fall back to F16), our
  file has the converter's metadata (general.* / tokenizer.* aside) and its tensors: the same names, types, shapes
  and bytes (router and expert bias F32, the fused experts as ffn_gate_exps | ffn_up_exps, ffn_down_exps);
- read back, the f32 file gives the HF model's weights and logits; q8_0 experts stay quantised;
- llama.cpp's logits on the converter's f32 file match ours on our file;
- what llama.cpp's lfm2moe graph cannot run is refused by name: routed_scaling_factor 1.5 (the lfm2_moe fixture),
  no expert bias (lfm2_moe_dense), a file whose gating function is not sigmoid.
"""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tests.weights.test_gguf_gemma3_lfm2 import _check_round_trip, check_converter_file  # noqa: E402
from tests.weights.test_gguf_qwen35 import _logits  # noqa: E402

from surojax.quant.model import is_quantized  # noqa: E402
from surojax.weights.gguf_checkpoint import hf_config_from_gguf, load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.gguf_reader import GGUFError  # noqa: E402
from surojax.weights.hf_checkpoint import load_model  # noqa: E402
from surojax.weights.safetensors_file import WeightsError  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
MODELS = FIXTURES / "models"
FOLDER = "lfm2_moe_gguf"
REF = json.loads((FIXTURES / "gguf" / "lfm2moe_converter.json").read_text())
CASES = sorted(REF)
LOGITS = FIXTURES / "gguf" / "logits_lfm2moe_f32.npy"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """"<folder>-<file type>" -> our .gguf of that HF fixture folder."""
    root = tmp_path_factory.mktemp("lfm2moe")
    return {case: save_gguf(MODELS / FOLDER, root / f"{case}.gguf", case.rsplit("-", 1)[1]) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_file_equals_the_converters(files, case):
    check_converter_file(files[case], REF[case])


def test_f32_round_trip_gives_the_hf_logits(files):
    """Every weight read back equals the checkpoint's (the expert bias too), the config its layer kinds, dense
    leading layers and router settings, and the logits transformers' (via the HF folder loaded by surojax, whose
    parity with transformers tests/models checks)."""
    hf = load_model(MODELS / FOLDER, dtype=jnp.float32)
    cfg, model, _ = load_gguf_model(files[f"{FOLDER}-f32"], dtype=jnp.float32)
    assert cfg.model_type == "lfm2_moe"
    assert (cfg.short_conv, cfg.dense_layers, cfg.moe, cfg.intermediate_size, cfg.rope_theta) == (
        hf.cfg.short_conv, hf.cfg.dense_layers, hf.cfg.moe, hf.cfg.intermediate_size, hf.cfg.rope_theta)
    assert cfg.dense_layers == 1 and cfg.moe.selection_bias
    _check_round_trip(hf, model, cfg)


def test_q8_0_read_back(files):
    _, kept, _ = load_gguf_model(files[f"{FOLDER}-q8_0"], dtype=jnp.float32)
    _, deq, _ = load_gguf_model(files[f"{FOLDER}-q8_0"], dtype=jnp.float32, keep_quantized=False)
    q = is_quantized(kept)
    assert not is_quantized(deq)
    assert {v for k, v in q.items() if "experts" in k} == {"q8_0"}, q
    np.testing.assert_allclose(_logits(kept), _logits(deq), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not LOGITS.is_file(), reason="llama.cpp's logits were not made (llama-cpp-python missing)")
def test_logits_match_llama_cpp(files):
    _, model, _ = load_gguf_model(files[f"{FOLDER}-f32"], dtype=jnp.float32)
    assert np.abs(_logits(model) - np.load(LOGITS)).max() < 1e-4


def test_what_llama_cpp_cannot_run_is_refused(tmp_path):
    tok = MODELS / FOLDER
    with pytest.raises(WeightsError, match=r"lfm2_moe routed_scaling_factor 1.5 cannot be written to GGUF"):
        save_gguf(MODELS / "lfm2_moe", tmp_path / "x.gguf", "f32", tokenizer_dir=tok)
    with pytest.raises(WeightsError, match=r"lfm2_moe with use_expert_bias false cannot be written.*exp_probs_b"):
        save_gguf(MODELS / "lfm2_moe_dense", tmp_path / "x.gguf", "f32", tokenizer_dir=tok)
    with pytest.raises(WeightsError, match=r"is written to GGUF as f32, f16, bf16, q8_0.*'q4_k_m'"):
        save_gguf(MODELS / FOLDER, tmp_path / "x.gguf", "q4_k_m")
    assert not (tmp_path / "x.gguf").exists()
    fields = {"general.architecture": "lfm2moe", **REF[f"{FOLDER}-f32"]["metadata"], "lfm2moe.expert_gating_func": 1}
    with pytest.raises(GGUFError, match=r"lfm2moe.expert_gating_func: expected 2 \(sigmoid"):
        hf_config_from_gguf(fields, "x.gguf")
