"""Qwen3.5 (qwen3_5_text / qwen3_5) as llama.cpp's `qwen35` GGUF, against llama.cpp's own converter
(tests/fixtures/gguf/qwen35_converter.json, made by scripts/make_qwen35_gguf_fixtures.py with the
convert_hf_to_gguf.py and gguf-py that llama-cpp-python 0.3.36 vendors):

- for the HF folders qwen3_5_gguf (f32, f16, q8_0; 2 key / 4 value heads: the value-head reorder applies),
  qwen3_5_text (untied head, key head dim 8 != value head dim 16) and qwen3_5 (Qwen3_5ForConditionalGeneration:
  the text model under model.language_model.*, the vision tower left out), our file has the converter's metadata
  (general.* / tokenizer.* aside) and its tensors: the same names, types, shapes and bytes (ssm_a = -exp(A_log)
  within 1 ulp: torch's exp and numpy's may round differently);
- read back, the f32 file gives the HF model's logits (to float32 rounding of A_log's round trip), and an f16 file
  the logits of the model whose 2-D weights are rounded to f16; q8_0 weights stay quantised (Q8_0) and give the
  logits of the dequantised model;
- llama.cpp's logits on the converter's f32 file (when the fixture has them) match ours on our file;
- a file type whose qwen35 mix is not modelled, and a corrupted ssm_a, fail clearly.
"""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from tests.weights.gguf_tiny import PROMPT_IDS  # noqa: E402

from surojax.quant.model import is_quantized  # noqa: E402
from surojax.weights.gguf_checkpoint import gguf_names, load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.hf_checkpoint import hf_tensors, load_model  # noqa: E402
from surojax.weights.safetensors_file import WeightsError  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
MODELS = FIXTURES / "models"
REF = json.loads((FIXTURES / "gguf" / "qwen35_converter.json").read_text())
LOGITS = FIXTURES / "gguf" / "logits_qwen35_f32.npy"
CASES = sorted(REF)


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
    meta.pop("qwen35.vocab_size")  # ours names it; the converter leaves it to the token list
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


@pytest.mark.parametrize("folder", ["qwen3_5_gguf", "qwen3_5_text", "qwen3_5"])
def test_f32_round_trip_gives_the_hf_logits(files, folder):
    hf = load_model(MODELS / folder, dtype=jnp.float32)
    cfg, model, _ = load_gguf_model(files[f"{folder}-f32"], dtype=jnp.float32)
    assert cfg.model_type == "qwen3_5_text" and cfg.linear_attention == hf.cfg.linear_attention
    assert (cfg.partial_rotary_factor, cfg.tie_word_embeddings) == (hf.cfg.partial_rotary_factor,
                                                                     hf.cfg.tie_word_embeddings)
    ids = [i % hf.cfg.vocab_size for i in PROMPT_IDS]
    ours, ref = hf_tensors(model), hf_tensors(hf)
    for name, value in ours.items():
        want = ref[name.replace("model.", "model.language_model.", 1) if folder == "qwen3_5"
                   and name.startswith("model.") else name]
        if name.endswith("A_log"):  # log(exp(x)) in float32
            np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(np.asarray(value) + 1, np.asarray(want) + 1, err_msg=name)
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


@pytest.mark.skipif(not LOGITS.is_file(), reason="llama.cpp's logits were not made (llama-cpp-python missing)")
def test_logits_match_llama_cpp(files):
    _, model, _ = load_gguf_model(files["qwen3_5_gguf-f32"], dtype=jnp.float32)
    ref = np.load(LOGITS)
    assert np.abs(_logits(model) - ref).max() < 5e-3


def test_names_of_the_multimodal_checkpoint():
    assert gguf_names("model.language_model.layers.3.linear_attn.A_log", "qwen35") == ("blk.3.ssm_a",)
    assert gguf_names("model.layers.0.post_attention_layernorm.weight", "qwen35") == (
        "blk.0.post_attention_norm.weight",)
    assert gguf_names("model.layers.0.post_attention_layernorm.weight") == ("blk.0.ffn_norm.weight",)


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
