"""GGUF out and in, against llama.cpp (golden fixtures from scripts/make_gguf_fixtures.py, llama-cpp-python 0.3.36):

- our writer's bytes are stable (sha256 of each tiny model's f32 / q8_0 / q4_k_m file);
- the q8_0 and q4_k_m files (and qwen3's q2_k, q3_k_m, q5_k_m, q6_k, iq4_xs) equal, tensor by tensor (type and
  bytes), what llama.cpp's own `llama_model_quantize` makes from our f32 file (so the mix rules and the
  quantisers' bytes are llama.cpp's);
- our logits on each file match llama.cpp's (logits_all) on the same file. Tolerances: f32 max |diff| < 5e-3
  (llama.cpp keeps the KV cache in f16); quantised files rms < 0.03 on logits of absmax ~3 (llama.cpp also
  quantises the activations to 8 bits in its quantised matmuls), and for q4_k_m our logits are > 4x closer to
  llama.cpp's than the unquantised model's are (the weight error dominates, and it is the same);
- load_gguf_model gives the HF model's logits exactly for f32, and with kept-quantised weights the logits of the
  dequantised model; the tokenizer is rebuilt from the metadata; a bad file fails with a clear error.
"""
import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from tests.weights.gguf_tiny import PROMPT_IDS, TOKENIZER_DIR, tiny_model_dir  # noqa: E402

from surojax.data.tokenizer import Tokenizer  # noqa: E402
from surojax.quant.model import is_quantized  # noqa: E402
from surojax.weights.gguf_checkpoint import _rope_permute, load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.hf_checkpoint import load_model  # noqa: E402
from surojax.weights.safetensors_file import WeightsError  # noqa: E402

GOLDEN = Path(__file__).parents[1] / "fixtures" / "gguf"
MANIFEST = json.loads((GOLDEN / "models.json").read_text())
FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_tied")
FILE_TYPES = ("f32", "q8_0", "q4_k_m")
TYPES_OF = {"qwen3": FILE_TYPES, "llama": FILE_TYPES, "qwen2": ("f32", "q8_0"), "qwen3_tied": ("f32", "q4_k_m")}
CASES = [(f, t) for f in FAMILIES for t in TYPES_OF[f]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (HF model dir, {file type: path of our .gguf})."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for fam in FAMILIES:
        d = tiny_model_dir(fam, root / fam)
        out[fam] = (d, {ft: save_gguf(d, root / f"{fam}-{ft}.gguf", ft) for ft in TYPES_OF[fam]})
    return out


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _logits(model):
    """Logits of PROMPT_IDS [T, V] through one jitted forward: the f32, HF and dequantised models of a family share
    one structure and so one compilation (an eager call compiles the layer scan again each time)."""
    return np.asarray(_forward(model, jnp.asarray([PROMPT_IDS])))[0]


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a))))


@pytest.mark.parametrize("fam,ft", CASES)
def test_writer_bytes_are_stable(files, fam, ft):
    path = files[fam][1][ft]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == MANIFEST["models"][f"{fam}-{ft}"]["sha256"]


@pytest.mark.parametrize("fam,ft", [c for c in CASES if c[1] != "f32"]
                         + [("qwen3", t) for t in ("q2_k", "q3_k_m", "q5_k_m", "q6_k", "iq4_xs")])
def test_tensors_equal_llama_quantize(files, fam, ft, tmp_path):
    path = files[fam][1].get(ft) or save_gguf(files[fam][0], tmp_path / f"{ft}.gguf", ft)
    reader = gguf.GGUFReader(path)
    ours = {t.name: [t.tensor_type.name.lower(), hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()]
            for t in reader.tensors}
    ref = MANIFEST["models"][f"{fam}-{ft}"]["llama_quantize"]
    assert set(ours) == set(ref)
    assert {k: v[0] for k, v in ours.items()} == {k: v[0] for k, v in ref.items()}  # the mix rule
    assert [k for k in ref if ours[k][1] != ref[k][1]] == []                        # the bytes


@pytest.mark.parametrize("fam", FAMILIES)
def test_logits_match_llama_cpp(files, fam):
    f32 = None
    for ft in TYPES_OF[fam]:
        _, model, _ = load_gguf_model(files[fam][1][ft], dtype=jnp.float32)
        ours = _logits(model)
        ref = np.load(GOLDEN / f"logits_{fam}_{ft}.npy")
        assert ours.shape == ref.shape == (len(PROMPT_IDS), 512)
        if ft == "f32":
            f32 = ours
            assert np.abs(ours - ref).max() < 5e-3
        else:
            assert _rms(ours - ref) < 0.03, (ft, _rms(ours - ref))
        if ft == "q4_k_m":
            assert _rms(ours - ref) * 4 < _rms(f32 - ref)


@pytest.mark.parametrize("fam", ["qwen3", "llama", "qwen2"])
def test_round_trip_logits(files, fam):
    hf_dir, paths = files[fam]
    ref = _logits(load_model(hf_dir, dtype=jnp.float32))
    cfg, model, _ = load_gguf_model(paths["f32"], dtype=jnp.float32)
    np.testing.assert_array_equal(_logits(model), ref)
    assert cfg.model_type == fam.removesuffix("_tied") and cfg.num_layers == 2 and cfg.head_dim == 64
    assert cfg.tie_word_embeddings == fam.endswith("_tied")
    if fam == "llama":
        assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    assert cfg.attention_bias == (fam == "qwen2") and cfg.qk_norm == fam.startswith("qwen3")
    ft = TYPES_OF[fam][-1]
    _, kept, _ = load_gguf_model(paths[ft], dtype=jnp.float32)
    _, deq, _ = load_gguf_model(paths[ft], dtype=jnp.float32, keep_quantized=False)
    q = is_quantized(kept)
    assert q["q_proj"] == ("q8_0" if ft == "q8_0" else "q4_k") and not is_quantized(deq)
    if ft == "q4_k_m":  # v / down are Q4_K on layer 0 and Q6_K on layer 1: one padded pytree
        assert q["v_proj"] == q["down_proj"] == "gguf_mixed"
    np.testing.assert_allclose(_logits(kept), _logits(deq), rtol=1e-5, atol=1e-5)


def test_tokenizer_rebuilt_from_metadata(files):
    _, _, tok = load_gguf_model(files["qwen3"][1]["q8_0"])
    hf_tok = Tokenizer.from_dir(TOKENIZER_DIR)
    text = "Hello world, <|im_start|>user\nthis is surojax 12345 ✅</think>"
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.decode(hf_tok.encode(text)) == text
    assert (tok.eos_token_id, tok.bos_token_id) == (hf_tok.eos_token_id, hf_tok.bos_token_id)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == hf_tok.apply_chat_template(msgs, tokenize=False)
    fields = gguf.GGUFReader(files["qwen3"][1]["q8_0"]).fields
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert fields["general.architecture"].contents() == "qwen3"


def test_rope_permute_inverse():
    w = np.arange(8 * 16 * 3).reshape(8 * 16, 3)
    p = _rope_permute(w, 8)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(_rope_permute(p, 8, inverse=True), w)
    np.testing.assert_array_equal(p[:4, 0], w[[0, 8, 1, 9], 0])  # head 0: rows 0, H/2, 1, H/2 + 1, ...


def test_bad_files_fail_clearly(tmp_path, files):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(WeightsError, match="bad.gguf: not a readable GGUF"):
        load_gguf_model(bad)
    with pytest.raises(WeightsError, match="GGUF file not found"):
        load_gguf_model(tmp_path / "missing.gguf")
    # a file with a tensor of the wrong shape: written by hand with GGUFWriter
    src = gguf.GGUFReader(files["qwen3"][1]["f32"])
    w = gguf.GGUFWriter(str(tmp_path / "shape.gguf"), "qwen3")
    for key, field in src.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        val = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, val, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, val, vtype)
    for t in src.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.1.ffn_up.weight":
            data = data[:128]
        w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightsError, match=r"shape.gguf: tensor blk.1.ffn_up.weight has shape \[128, 256\]"):
        load_gguf_model(tmp_path / "shape.gguf")


def test_llama_cpp_live(files):
    """When llama-cpp-python is importable here, run it on our q4_k_m file directly (skipped otherwise: the golden
    logits above cover CI)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = files["qwen3"][1]["q4_k_m"]
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(PROMPT_IDS)
    ref = np.asarray(llm.scores[:len(PROMPT_IDS)], np.float32)
    _, model, _ = load_gguf_model(path, dtype=jnp.float32)
    assert _rms(_logits(model) - ref) < 0.03


def test_llama3_style_tokenizer_metadata(tmp_path):
    """A Llama 3 style tokenizer (its split regex, ignore_merges, a bos-prepending post-processor) is written as
    pre "llama-bpe" with add_bos_token, and the tokenizer rebuilt from those fields encodes the same ids."""
    import shutil

    from surojax.weights.gguf_tokenizer import LLAMA3_SPLIT, tokenizer_from_fields, tokenizer_metadata

    d = tmp_path / "tok"
    shutil.copytree(TOKENIZER_DIR, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_SPLIT
    tj["model"]["ignore_merges"] = True
    tj["normalizer"] = None
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [507],
                                                                 "tokens": ["<|endoftext|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    meta = tokenizer_metadata(d, 512)
    assert meta["pre"] == "llama-bpe" and meta["add_bos_token"] and meta["bos_token_id"] == 507
    assert meta["token_type"][507] == 3 and meta["token_type"][0] == 1  # CONTROL, NORMAL
    fields = {f"tokenizer.ggml.{k}": v for k, v in meta.items() if k != "chat_template"}
    fields["tokenizer.ggml.tokens"] = meta["tokens"]
    rebuilt = tokenizer_from_fields(fields, "test")
    text = "Hello world 12345 1234567, it's <|im_start|>"
    assert rebuilt.encode(text, add_special_tokens=True) == Tokenizer.from_dir(d).encode(text, add_special_tokens=True)
    assert rebuilt.encode(text, add_special_tokens=True)[0] == 507
