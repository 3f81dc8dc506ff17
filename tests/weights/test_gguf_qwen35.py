"""Qwen3.5 (qwen3_5_text / qwen3_5) as llama.cpp's `qwen35` GGUF and Qwen3.5-MoE (qwen3_5_moe_text / qwen3_5_moe)
as `qwen35moe`, against llama.cpp's own converter (tests/fixtures/gguf/qwen35_converter.json and
qwen35moe_converter.json, made by scripts/make_qwen35_gguf_fixtures.py with the convert_hf_to_gguf.py and gguf-py
that llama-cpp-python 0.3.36 vendors):

- for the HF folders qwen3_5_gguf (f32, f16, q8_0; 2 key / 4 value heads: the value-head reorder applies),
  qwen3_5_text (untied head, key head dim 8 != value head dim 16) and qwen3_5 (Qwen3_5ForConditionalGeneration:
  the text model under model.language_model.*, the vision tower left out), our file has the converter's metadata
  (general.* / tokenizer.* aside) and its tensors: the same names, types, shapes and bytes (ssm_a = -exp(A_log)
  within 1 ulp: torch's exp and numpy's may round differently);
- read back, the f32 file gives the HF model's logits (to float32 rounding of A_log's round trip), and an f16 file
  the logits of the model whose 2-D weights are rounded to f16; q8_0 weights stay quantised (Q8_0) and give the
  logits of the dequantised model;
- the same for the MoE folders qwen3_5_moe_gguf (f32, q8_0: every expert row quantises), qwen3_5_moe_text (f32,
  q8_0: the expert / shared-expert down rows of 16 / 24 values fall back to F16, as the converter does) and
  qwen3_5_moe: the router and the shared expert's gate F32, the stacked experts, the shared expert, the expert
  widths' keys and no feed_forward_length; read back, the f32 files give transformers' logits (expected.npz), and
  q8_0 experts and shared experts stay quantised;
- llama.cpp's logits on the converter's f32 file (when the fixture has them) match ours on our file;
- a file type whose hybrid mix is not modelled (here, and for training: quantize_model_mix), a corrupted ssm_a and
  a qwen35moe file without its expert widths fail clearly; with only feed_forward_length the widths are llama.cpp's
  fallbacks.
"""
import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from tests.weights.gguf_tiny import PROMPT_IDS  # noqa: E402

from surojax.quant.model import is_quantized, quantize_model_mix  # noqa: E402
from surojax.weights.gguf_checkpoint import gguf_names, hf_config_from_gguf, load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.hf_checkpoint import hf_tensors, load_model  # noqa: E402
from surojax.weights.safetensors_file import WeightsError  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
MODELS = FIXTURES / "models"
ARCHS = ("qwen35", "qwen35moe")
REF = {case: ref for arch in ARCHS
       for case, ref in json.loads((FIXTURES / "gguf" / f"{arch}_converter.json").read_text()).items()}
CASES = sorted(REF)
RUNNABLE = {"qwen35": "qwen3_5_gguf", "qwen35moe": "qwen3_5_moe_gguf"}  # llama.cpp runs these shapes


def _byte_tokenizer(out: Path) -> Path:
    """A byte-level BPE of the 256 byte tokens (for the vocab-256 fixtures, which carry no tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """"<folder>-<file type>" -> our .gguf of that HF fixture folder."""
    root = tmp_path_factory.mktemp("qwen35")
    byte_tok = _byte_tokenizer(root / "bytes")
    out = {}
    for case in CASES:
        folder, ft = case.rsplit("-", 1)
        tok = MODELS / folder if (MODELS / folder / "tokenizer.json").is_file() else byte_tok
        out[case] = save_gguf(MODELS / folder, root / f"{case}.gguf", ft, tokenizer_dir=tok)
    return out


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _logits(model, ids=PROMPT_IDS):
    return np.asarray(_forward(model, jnp.asarray([ids])))[0]


@pytest.mark.parametrize("case", CASES)
def test_file_equals_the_converters(files, case):
    import hashlib

    ref = REF[case]
    r = gguf.GGUFReader(files[case])
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith(("general.", "tokenizer.", "GGUF."))}
    meta.pop(f"{r.fields['general.architecture'].contents()}.vocab_size")  # the converter leaves it to the tokens
    assert meta == ref["metadata"]
    ours = {t.name: t for t in r.tensors}
    assert sorted(ours) == sorted(ref["tensors"])
    for name, (typ, shape, digest) in ref["tensors"].items():
        t = ours[name]
        assert [t.tensor_type.name, [int(n) for n in t.shape]] == [typ, shape], name
        if name.endswith("ssm_a"):
            np.testing.assert_allclose(np.asarray(t.data).reshape(-1), ref["ssm_a"][name], rtol=2e-7, atol=0)
        else:
            assert hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest() == digest, name


@pytest.mark.parametrize("folder", ["qwen3_5_gguf", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"])
def test_f32_round_trip_gives_the_hf_logits(files, folder):
    """Every weight read back equals the checkpoint's; the logits are transformers' (the folder's expected.npz;
    qwen3_5_gguf has none: the HF folder loaded by surojax)."""
    hf = load_model(MODELS / folder, dtype=jnp.float32)
    cfg, model, _ = load_gguf_model(files[f"{folder}-f32"], dtype=jnp.float32)
    assert cfg.model_type == ("qwen3_5_moe_text" if hf.cfg.moe else "qwen3_5_text")
    assert cfg.linear_attention == hf.cfg.linear_attention  # with the layer pattern
    if hf.cfg.moe:  # the aux-loss coefficient is a training setting, not in the file (transformers' default read)
        assert cfg.moe == dataclasses.replace(hf.cfg.moe, router_aux_loss_coef=cfg.moe.router_aux_loss_coef)
    assert (cfg.partial_rotary_factor, cfg.tie_word_embeddings) == (hf.cfg.partial_rotary_factor,
                                                                     hf.cfg.tie_word_embeddings)
    ours, ref = hf_tensors(model), hf_tensors(hf)
    multimodal = folder in ("qwen3_5", "qwen3_5_moe")
    assert len(ours) == len(ref)
    for name, value in ours.items():
        want = ref[name.replace("model.", "model.language_model.", 1) if multimodal
                   and name.startswith("model.") else name]
        if name.endswith("A_log"):  # log(exp(x)) in float32
            np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(np.asarray(value) + 1, np.asarray(want) + 1, err_msg=name)
    expected = MODELS / folder / "expected.npz"
    if expected.is_file():
        exp = np.load(expected)
        np.testing.assert_allclose(_logits(model, list(exp["tokens2"])), exp["logits2"], rtol=1e-4, atol=1e-4)
    else:
        ids = [i % hf.cfg.vocab_size for i in PROMPT_IDS]
        np.testing.assert_allclose(_logits(model, ids), _logits(hf, ids), rtol=1e-5, atol=1e-5)


def test_f16_and_q8_0_read_back(files):
    hf = load_model(MODELS / "qwen3_5_gguf", dtype=jnp.float32)
    _, f16, _ = load_gguf_model(files["qwen3_5_gguf-f16"], dtype=jnp.float32)
    ref = hf_tensors(hf)
    for name, value in hf_tensors(f16).items():
        want = np.asarray(ref[name])
        if want.ndim == 2 and "conv1d" not in name:
            want = want.astype(np.float16).astype(np.float32)
        if not name.endswith("A_log"):
            np.testing.assert_array_equal(np.asarray(value) + 1, want + 1, err_msg=name)
    _, kept, _ = load_gguf_model(files["qwen3_5_gguf-q8_0"], dtype=jnp.float32)
    _, deq, _ = load_gguf_model(files["qwen3_5_gguf-q8_0"], dtype=jnp.float32, keep_quantized=False)
    q = is_quantized(kept)
    assert q["linear_layers.in_proj_qkv"] == q["linear_layers.in_proj_z"] == q["q_proj"] == "q8_0"
    assert "linear_layers.out_proj" not in q and not is_quantized(deq)  # value-head order moves its columns
    np.testing.assert_allclose(_logits(kept), _logits(deq), rtol=1e-5, atol=1e-5)


def test_moe_q8_0_experts_stay_quantised(files):
    """Q8_0 experts (both stacks, in the grouped-GEMM layout) and shared experts are kept as read, each value where
    the dequantised read puts it; the down rows the converter wrote as F16 (16 / 24 values: no Q8_0 block) are
    dequantised."""
    _, kept, _ = load_gguf_model(files["qwen3_5_moe_gguf-q8_0"], dtype=jnp.float32)
    _, deq, _ = load_gguf_model(files["qwen3_5_moe_gguf-q8_0"], dtype=jnp.float32, keep_quantized=False)
    q = is_quantized(kept)
    for stack in ("", "linear_layers."):
        for target in ("experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj",
                       "shared_expert.up_proj", "shared_expert.down_proj"):
            assert q[stack + target] == "q8_0", stack + target
    assert not is_quantized(deq)
    # where the bytes went (the quantised matmuls themselves: tests/quant): each kept Q8_0 kernel decoded by gguf-py
    # is the dequantised read's kernel
    want = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(deq, nnx.Param))}
    n = 0
    for p, v in nnx.to_flat_state(nnx.state(kept, nnx.Param)):
        value = v.get_value()
        if hasattr(value, "data") and value.name == "q8_0":
            raw = np.asarray(value.data).view(np.uint8)  # [..., N, row bytes]
            rows = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
            np.testing.assert_array_equal(np.swapaxes(rows, -1, -2), want[".".join(map(str, p))], err_msg=str(p))
            n += 1
    assert n == len(is_quantized(kept))
    _, fallback, _ = load_gguf_model(files["qwen3_5_moe_text-q8_0"], dtype=jnp.float32)
    q = is_quantized(fallback)
    assert q["experts.gate_up_proj"] == q["linear_layers.shared_expert.up_proj"] == "q8_0"
    assert not {"experts.down_proj", "linear_layers.experts.down_proj", "shared_expert.down_proj"} & set(q)


@pytest.mark.parametrize("arch", [
    pytest.param(arch, marks=pytest.mark.skipif(not (FIXTURES / "gguf" / f"logits_{arch}_f32.npy").is_file(),
                                                reason="llama.cpp's logits were not made (llama-cpp-python missing)"))
    for arch in ARCHS])
def test_logits_match_llama_cpp(files, arch):
    _, model, _ = load_gguf_model(files[f"{RUNNABLE[arch]}-f32"], dtype=jnp.float32)
    ref = np.load(FIXTURES / "gguf" / f"logits_{arch}_f32.npy")
    assert np.abs(_logits(model) - ref).max() < 1e-3  # 2.1e-4 (qwen35) and 2.8e-4 (qwen35moe) when made


def test_names_of_the_multimodal_checkpoint():
    assert gguf_names("model.language_model.layers.3.linear_attn.A_log", "qwen35") == ("blk.3.ssm_a",)
    assert gguf_names("model.layers.0.post_attention_layernorm.weight", "qwen35") == (
        "blk.0.post_attention_norm.weight",)
    assert gguf_names("model.layers.0.post_attention_layernorm.weight") == ("blk.0.ffn_norm.weight",)
    assert gguf_names("model.language_model.layers.2.mlp.shared_expert_gate.weight", "qwen35moe") == (
        "blk.2.ffn_gate_inp_shexp.weight",)
    assert gguf_names("model.language_model.layers.2.mlp.experts.gate_up_proj", "qwen35moe") == (
        "blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight")


def test_bad_input_fails_clearly(files, tmp_path):
    with pytest.raises(WeightsError, match=r"qwen3_5_text is written to GGUF as f32, f16, bf16, q8_0.*'q4_k_m'"):
        save_gguf(MODELS / "qwen3_5_gguf", tmp_path / "x.gguf", "q4_k_m")
    r = gguf.GGUFReader(files["qwen3_5_gguf-f32"])
    t = next(t for t in r.tensors if t.name == "blk.1.ssm_a")
    data = bytearray(Path(files["qwen3_5_gguf-f32"]).read_bytes())
    start = int(t.data_offset)
    data[start:start + 4] = np.float32(0.5).tobytes()
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"bad.gguf: tensor blk.1.ssm_a: expected negative values"):
        load_gguf_model(tmp_path / "bad.gguf")
    with pytest.raises(WeightsError, match=r"qwen3_5_moe_text is written to GGUF as .*'q4_k_m'.*qwen35moe"):
        save_gguf(MODELS / "qwen3_5_moe_text", tmp_path / "x.gguf", "q4_k_m")
    # rope sections wider than the rotary dimension (4 dims: 2 pairs): llama.cpp would assert running the file
    wide = tmp_path / "wide"
    shutil.copytree(MODELS / "qwen3_5_gguf", wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["rope_parameters"]["mrope_section"] = [11, 11, 10]
    (wide / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"mrope_section \[11, 11, 10\] gives 32 .* rotary dimension 4 has 2"):
        save_gguf(wide, tmp_path / "x.gguf", "f32")


@pytest.mark.parametrize("folder", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_llama_cpp_mix_is_refused_for_training_hybrids(folder):
    model = load_model(MODELS / folder, dtype=jnp.float32)
    with pytest.raises(ValueError, match=rf"per-tensor mix \(q4_k_m\) is not defined for a hybrid \({folder}"):
        quantize_model_mix(model, "q4_k_m")


def test_moe_expert_widths_from_the_metadata(files):
    """qwen35moe without expert_feed_forward_length / expert_shared_feed_forward_length: llama.cpp's fallbacks from
    feed_forward_length (n_ff / expert_used_count, n_ff), else a clear error naming the keys."""
    from surojax.weights.gguf_split import read_gguf_model

    fields = dict(read_gguf_model(files["qwen3_5_moe_text-f32"]).fields)
    hf = hf_config_from_gguf(fields, "m.gguf")
    assert (hf["model_type"], hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]) == (
        "qwen3_5_moe_text", 16, 24) and "intermediate_size" not in hf
    for key in ("qwen35moe.expert_feed_forward_length", "qwen35moe.expert_shared_feed_forward_length"):
        del fields[key]
    with pytest.raises(WeightsError, match=r"m.gguf: qwen35moe.expert_used_count 2, expert_feed_forward_length 0 "
                                           r"and expert_shared_feed_forward_length 0 \(or feed_forward_length\)"):
        hf_config_from_gguf(fields, "m.gguf")
    fields["qwen35moe.feed_forward_length"] = 48
    hf = hf_config_from_gguf(fields, "m.gguf")
    assert (hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]) == (24, 48)
    fields["qwen35moe.expert_count"] = 0
    with pytest.raises(WeightsError, match=r"m.gguf: qwen35moe.expert_count: expected a positive expert count"):
        hf_config_from_gguf(fields, "m.gguf")
