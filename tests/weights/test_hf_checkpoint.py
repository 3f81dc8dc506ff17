"""Hugging Face checkpoint folders <-> Decoder: loading (single file, sharded, fp16/bf16, bf16 compute, HF cache),
clear errors that name the file, the tensor and what was expected, and save_model round trips (also read back
by transformers itself when the reference environment exists)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from surojax.hub import ModelNotFoundError
from surojax.models.config import ModelConfig
from surojax.models import registry
from surojax.weights.hf_checkpoint import hf_tensors, load_model, open_checkpoint, read_config, save_model
from surojax.weights.safetensors_file import SafetensorsFile, WeightsError, write_safetensors

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4"]
REF_PYTHON = Path(os.environ.get("SUROJAX_REF_PYTHON", "/work/refenv/bin/python"))
CHECK_SCRIPT = ROOT / "scripts" / "check_transformers_load.py"
HF_TOL = 1e-4  # fp32 parity with the fixtures' transformers logits (ARCHITECTURE.md's correctness protocol)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def logits(model, seq) -> np.ndarray:
    """[T, V] fp32 logits of one sequence (jitted: one compile per family and dtype)."""
    return np.asarray(_forward(model, jnp.asarray([seq], jnp.int32)), np.float32)[0]


def params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape, k
        assert pa[k].tobytes() == pb[k].tobytes(), k


def expected(family: str):
    return np.load(FIXTURES / family / "expected.npz")


def fixture_tensors(family: str = "llama") -> dict[str, np.ndarray]:
    f = SafetensorsFile(FIXTURES / family / "model.safetensors")
    return {n: np.array(f.get(n)) for n in f.names()}


def fixture_config(family: str = "llama") -> dict:
    return json.loads((FIXTURES / family / "config.json").read_text())


def make_checkpoint(d: Path, family: str = "llama", tensors: dict | None = None, config: dict | None = None) -> Path:
    """A model folder in d: the fixture's config.json and weights, or the given ones."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config if config is not None else fixture_config(family)))
    write_safetensors(d / "model.safetensors", tensors if tensors is not None else fixture_tensors(family))
    return d


def write_sharded(d: Path, tensors: dict, n_shards: int) -> None:
    names = list(tensors)
    weight_map = {}
    for k in range(n_shards):
        fname = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = names[k::n_shards]  # interleaved: every layer's tensors are spread over all shards
        write_safetensors(d / fname, {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def originals():
    """The fixture models, loaded once."""
    return {f: load_model(FIXTURES / f) for f in FAMILIES}


def load_error(d, **kw) -> str:
    with pytest.raises(WeightsError) as e:
        load_model(d, **kw)
    assert e.value.is_user_error
    return str(e.value)


# ---- loading ------------------------------------------------------------------------------------------------------

def test_fixture_loads_with_hf_logits(originals):
    model = originals["llama"]
    exp = expected("llama")
    assert model.cfg.rope_scaling.rope_type == "llama3"
    assert np.abs(logits(model, exp["tokens2"]) - exp["logits2"]).max() <= HF_TOL


def test_sharded_checkpoint_equals_single_file(tmp_path, originals):
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(FIXTURES / "qwen2" / "config.json", d)
    write_sharded(d, fixture_tensors("qwen2"), 3)
    assert len(set(open_checkpoint(d).values())) == 3
    model = load_model(d)
    assert_same_params(model, originals["qwen2"])
    exp = expected("qwen2")
    np.testing.assert_array_equal(logits(model, exp["tokens2"]), logits(originals["qwen2"], exp["tokens2"]))


# Tolerances from measuring all five fixtures (logits up to |7|): rounding the weights to fp16 moves the logits by
# <= 0.017, to bf16 (8 mantissa bits) by <= 0.15; bf16 compute as well adds rounding of every activation (<= 0.25).
HALF_TOL = {"float16": 0.05, "bfloat16": 0.3}
BF16_COMPUTE_TOL = 0.5


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_precision_checkpoint_loads(tmp_path, half, originals):
    dt = np.dtype(ml_dtypes.bfloat16) if half == "bfloat16" else np.dtype(np.float16)
    d = make_checkpoint(tmp_path / half, "qwen3", {n: t.astype(dt) for n, t in fixture_tensors("qwen3").items()})
    assert {SafetensorsFile(d / "model.safetensors").dtype(n) for n in ["model.norm.weight"]} == {dt}
    model = load_model(d)  # fp32 compute: the half weights are upcast exactly
    ref = params(originals["qwen3"])
    for k, v in params(model).items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, ref[k].astype(dt).astype(np.float32), err_msg=k)
    exp = expected("qwen3")
    assert np.abs(logits(model, exp["tokens2"]) - exp["logits2"]).max() <= HALF_TOL[half]


def test_load_with_bfloat16_dtype(originals):
    model = load_model(FIXTURES / "mistral", dtype=jnp.bfloat16)
    assert {v.dtype for v in params(model).values()} == {np.dtype(ml_dtypes.bfloat16)}
    ref = params(originals["mistral"])
    for k, v in params(model).items():  # fp32 -> bf16 is a plain round to nearest
        np.testing.assert_array_equal(v, ref[k].astype(ml_dtypes.bfloat16), err_msg=k)
    exp = expected("mistral")
    out = logits(model, exp["tokens2"])
    assert np.isfinite(out).all() and np.abs(out - exp["logits2"]).max() <= BF16_COMPUTE_TOL
    assert (out.argmax(-1) == exp["logits2"].argmax(-1)).mean() >= 0.75


def test_rotary_inv_freq_buffers_are_ignored(tmp_path, originals):
    tensors = fixture_tensors("qwen3") | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    assert_same_params(load_model(make_checkpoint(tmp_path / "m", "qwen3", tensors)), originals["qwen3"])


def test_tied_model_with_a_saved_lm_head_loads_and_ignores_it(tmp_path, originals):
    tensors = fixture_tensors("llama_tied")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = np.full_like(tensors["model.embed_tokens.weight"], 123.0)  # must not be used
    model = load_model(make_checkpoint(tmp_path / "tied", "llama_tied", tensors))
    assert_same_params(model, originals["llama_tied"])
    exp = expected("llama_tied")
    assert np.abs(logits(model, exp["tokens2"]) - exp["logits2"]).max() <= HF_TOL


# ---- errors -------------------------------------------------------------------------------------------------------

def test_missing_config_json(tmp_path):
    d = make_checkpoint(tmp_path / "m")
    (d / "config.json").unlink()
    msg = load_error(d)
    assert str(d) in msg and "no config.json" in msg and "Hugging Face model folder" in msg


def test_bad_config_json(tmp_path):
    d = make_checkpoint(tmp_path / "m")
    (d / "config.json").write_text('{"model_type": "llama", ')
    msg = load_error(d)
    assert str(d / "config.json") in msg and "not valid JSON" in msg
    (d / "config.json").write_text(json.dumps(fixture_config() | {"model_type": "gpt2"}))
    msg = load_error(d)
    assert str(d / "config.json") in msg and "'gpt2' is not supported" in msg
    assert ", ".join(sorted(registry.FAMILIES)) in msg and "gemma3_text, gemma4" in msg  # every supported one, sorted


def test_missing_weights_file_with_pytorch_bin_hint(tmp_path):
    d = make_checkpoint(tmp_path / "m")
    (d / "model.safetensors").unlink()
    msg = load_error(d)
    assert str(d) in msg and "no model.safetensors or model.safetensors.index.json" in msg
    assert "convert" not in msg
    (d / "pytorch_model.bin").write_bytes(b"\x80\x02")
    msg = load_error(d)
    assert "found pytorch_model.bin" in msg and "convert them to safetensors" in msg


def test_index_pointing_to_a_missing_shard(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(FIXTURES / "llama" / "config.json", d)
    write_sharded(d, fixture_tensors(), 2)
    (d / "model-00002-of-00002.safetensors").unlink()
    msg = load_error(d)
    assert str(d / "model-00002-of-00002.safetensors") in msg and "shard file not found" in msg
    assert "model.safetensors.index.json" in msg
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    first = sorted(n for n, f in index.items() if f == "model-00002-of-00002.safetensors")[0]
    assert first in msg  # a tensor the missing shard should hold


def test_index_listing_a_tensor_its_shard_lacks(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(FIXTURES / "llama" / "config.json", d)
    write_sharded(d, fixture_tensors(), 2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(n for n, f in index["weight_map"].items() if f == "model-00002-of-00002.safetensors")
    index["weight_map"][name] = "model-00001-of-00002.safetensors"  # but it is in shard 2
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = load_error(d)
    assert str(d / "model-00001-of-00002.safetensors") in msg and f"tensor {name!r}" in msg
    assert "the index lists" in msg
    (d / "model.safetensors.index.json").write_text('{"weight_map": ["not", "a", "dict"]}')
    assert "not a valid safetensors index" in load_error(d)
    (d / "model.safetensors.index.json").write_text("{}")
    assert "not a valid safetensors index" in load_error(d)


def test_shape_mismatch_names_both_shapes(tmp_path):
    tensors = fixture_tensors()
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((96, 64), np.float32)  # intermediate 128 in config
    msg = load_error(make_checkpoint(tmp_path / "m", tensors=tensors))
    assert "model.safetensors: tensor model.layers.1.mlp.up_proj.weight" in msg
    assert "has shape [96, 64], the config implies [128, 64]" in msg
    assert "do not match config.json (llama)" in msg


def test_config_that_does_not_fit_the_weights(tmp_path):
    """The other way round: the weights are right, config.json is wrong (hidden size)."""
    cfg = fixture_config() | {"intermediate_size": 256}
    msg = load_error(make_checkpoint(tmp_path / "m", config=cfg))
    assert "model.layers.0.mlp.gate_proj.weight has shape [128, 64], the config implies [256, 64]" in msg


def test_truncated_weights_file(tmp_path):
    d = make_checkpoint(tmp_path / "m")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:len(raw) // 2])
    msg = load_error(d)
    assert str(d / "model.safetensors") in msg and "truncated: tensor" in msg
    assert f"but the file has {len(raw) // 2} bytes" in msg


def test_corrupt_weights_header(tmp_path):
    d = make_checkpoint(tmp_path / "m")
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[8:40] = b"\x00garbage garbage garbage garbage"
    (d / "model.safetensors").write_bytes(bytes(raw))
    msg = load_error(d)
    assert str(d / "model.safetensors") in msg and "corrupt safetensors header" in msg
    (d / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\n")
    msg = load_error(d)  # a Git LFS pointer instead of the weights
    assert str(d / "model.safetensors") in msg and "corrupt or truncated safetensors header" in msg


def test_missing_tensors_are_listed(tmp_path):
    tensors = fixture_tensors("qwen3")
    del tensors["model.layers.1.self_attn.k_norm.weight"], tensors["lm_head.weight"]
    msg = load_error(make_checkpoint(tmp_path / "m", "qwen3", tensors))
    assert str(tmp_path / "m") in msg
    assert "missing tensors (2): lm_head.weight, model.layers.1.self_attn.k_norm.weight" in msg
    assert "unexpected" not in msg


def test_many_missing_tensors_are_summarised(tmp_path):
    tensors = {n: t for n, t in fixture_tensors().items() if ".layers.1." not in n}
    msg = load_error(make_checkpoint(tmp_path / "m", tensors=tensors))
    assert "missing tensors (9): model.layers.1." in msg and "... and 1 more" in msg


def test_unexpected_tensors_are_listed(tmp_path):
    tensors = fixture_tensors() | {"model.layers.0.mlp.up_proj.bias": np.zeros(128, np.float32),
                                   "model.layers.2.input_layernorm.weight": np.zeros(64, np.float32)}
    msg = load_error(make_checkpoint(tmp_path / "m", tensors=tensors))
    assert ("unexpected tensors (2): model.layers.0.mlp.up_proj.bias, model.layers.2.input_layernorm.weight"
            in msg)
    assert "missing" not in msg


def test_bias_mismatch_between_config_and_weights(tmp_path):
    """qwen2 weights under a llama config: the q/k/v biases are unexpected tensors, not silently dropped."""
    cfg = fixture_config("qwen2") | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    msg = load_error(make_checkpoint(tmp_path / "m", "qwen2", config=cfg))
    assert "unexpected tensors (6): model.layers.0.self_attn.k_proj.bias" in msg


def test_integer_weights_are_refused(tmp_path):
    tensors = fixture_tensors()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    msg = load_error(make_checkpoint(tmp_path / "m", tensors=tensors))
    assert "model.safetensors: tensor model.norm.weight has dtype int8, expected a float" in msg


# ---- HF cache -----------------------------------------------------------------------------------------------------

@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache only (tests/test_hub.py fetches from a stand-in Hub)
    return cache


def fake_cached_repo(cache: Path, repo_id: str, src: Path, commit: str = "c0ffee" * 6 + "beef") -> Path:
    """The layout huggingface_hub writes: blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in src.iterdir() if p.name != "expected.npz")):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_repo_id_from_the_hf_cache_loads(hf_cache, originals):
    snap = fake_cached_repo(hf_cache, "tiny-org/tiny-qwen3", FIXTURES / "qwen3")
    assert (snap / "model.safetensors").is_symlink()
    model = load_model("tiny-org/tiny-qwen3")
    assert_same_params(model, originals["qwen3"])
    exp = expected("qwen3")
    assert np.abs(logits(model, exp["tokens2"]) - exp["logits2"]).max() <= HF_TOL


def test_repo_id_missing_from_the_hf_cache(hf_cache):
    with pytest.raises(ModelNotFoundError) as e:
        load_model("tiny-org/not-there")
    msg = str(e.value)
    assert "'tiny-org/not-there'" in msg and str(hf_cache) in msg and "offline (HF_HUB_OFFLINE is set)" in msg
    assert getattr(e.value, "is_user_error", False)


# ---- save ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_load_round_trip(tmp_path, family, originals):
    model = originals[family]
    out = save_model(model, tmp_path / "out", tokenizer_dir=FIXTURES / family)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "generation_config.json", "special_tokens_map.json",
         "tokenizer.json", "tokenizer_config.json"])
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left behind
    written = SafetensorsFile(out / "model.safetensors")
    # exactly HF's names (tied: no lm_head; MXFP4 experts saved dequantised under the plain name)
    names = {n.removesuffix("_blocks").removesuffix("_scales") for n in fixture_tensors(family)}
    assert sorted(written.names()) == sorted(names)
    back = load_model(out)
    assert back.cfg == model.cfg
    assert_same_params(back, model)
    exp = expected(family)
    np.testing.assert_array_equal(logits(back, exp["tokens2"]), logits(model, exp["tokens2"]))
    hf = json.loads((out / "config.json").read_text())
    assert hf["dtype"] == "float32" and hf["architectures"] == fixture_config(family)["architectures"]


def test_saved_folder_has_the_usual_modes(tmp_path, originals):
    """Every file of a saved folder gets 0666 & ~umask and the folder 0777 & ~umask, as anything the user makes:
    not the 0600 of safetensors' temporary file, nor a read-only tokenizer source's mode."""
    src = tmp_path / "tok"
    shutil.copytree(FIXTURES / "llama", src)
    for p in src.iterdir():
        p.chmod(0o444)
    old = os.umask(0o027)
    try:
        out = save_model(originals["llama"], tmp_path / "out", tokenizer_dir=src)
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {p.name: oct(0o640) for p in out.iterdir()}


def test_saved_config_keys(tmp_path, originals):
    """What transformers needs: rope_parameters (v5) and rope_scaling / rope_theta (older), qwen2 without the
    attention_bias key (it always has q/k/v biases), mistral's window."""
    llama = json.loads((save_model(originals["llama"], tmp_path / "llama") / "config.json").read_text())
    assert llama["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32}
    assert llama["rope_scaling"]["type"] == llama["rope_scaling"]["rope_type"] == "llama3"
    assert llama["rope_theta"] == 10000.0 and llama["attention_bias"] is False
    assert read_config(tmp_path / "llama") == originals["llama"].cfg
    qwen2 = json.loads((save_model(originals["qwen2"], tmp_path / "qwen2") / "config.json").read_text())
    assert "attention_bias" not in qwen2 and "rope_scaling" not in qwen2
    assert qwen2["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    mistral = json.loads((save_model(originals["mistral"], tmp_path / "mistral") / "config.json").read_text())
    assert mistral["sliding_window"] == 6


def test_save_into_a_non_empty_folder_refuses_and_leaves_it_untouched(tmp_path, originals):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "model.safetensors").write_bytes(b"old weights")
    with pytest.raises(WeightsError, match="exists and is not empty; choose another output folder") as e:
        save_model(originals["llama"], out)
    assert str(out) in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me" and (out / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    save_model(originals["llama"], out, overwrite=True)  # asked for: replaced as a whole
    assert not (out / "notes.txt").exists()
    assert_same_params(load_model(out), originals["llama"])


def test_save_into_an_empty_folder_or_onto_a_file(tmp_path, originals):
    (tmp_path / "empty").mkdir()
    save_model(originals["llama_tied"], tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(WeightsError, match="is not a folder"):
        save_model(originals["llama_tied"], tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_saved_folder_has_the_usual_permissions(tmp_path, originals):
    """Not the 0700 of a temporary folder: the mode a plain mkdir gives (so other users / containers can read)."""
    out = save_model(originals["llama_tied"], tmp_path / "deep" / "out")
    (tmp_path / "probe").mkdir()
    assert out.stat().st_mode & 0o777 == (tmp_path / "probe").stat().st_mode & 0o777


def test_failed_save_leaves_nothing(tmp_path, originals, monkeypatch):
    import surojax.weights.hf_checkpoint as hfc

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hfc, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(originals["llama"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_sharded_save(tmp_path, originals):
    model = originals["qwen2"]
    limit = 40_000  # the embedding and head (131 KB each) get shards of their own, layers are grouped
    out = save_model(model, tmp_path / "out", max_shard_bytes=limit)
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = hf_tensors(model)
    assert index["weight_map"].keys() == tensors.keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for s in shards:
        f = SafetensorsFile(out / s)
        sizes = [f.get(n).nbytes for n in f.names()]
        assert sum(sizes) <= limit or len(sizes) == 1, s
    back = load_model(out)
    assert_same_params(back, model)
    exp = expected("qwen2")
    np.testing.assert_array_equal(logits(back, exp["tokens2"]), logits(model, exp["tokens2"]))


def test_save_in_bfloat16(tmp_path, originals):
    out = save_model(originals["qwen3"], tmp_path / "bf16", dtype=jnp.bfloat16)
    hf = json.loads((out / "config.json").read_text())
    assert hf["dtype"] == hf["torch_dtype"] == "bfloat16"
    f = SafetensorsFile(out / "model.safetensors")
    assert {f.dtype(n) for n in f.names()} == {np.dtype(ml_dtypes.bfloat16)}
    assert (out / "model.safetensors").stat().st_size < (FIXTURES / "qwen3" / "model.safetensors").stat().st_size * 0.6
    back = load_model(out)
    ref = params(originals["qwen3"])
    for k, v in params(back).items():
        np.testing.assert_array_equal(v, ref[k].astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=k)


# ---- transformers reads what we save ------------------------------------------------------------------------------

def _check_with_transformers(run, tmp_path, originals) -> dict[str, dict]:
    specs = []
    for family in FAMILIES:
        out = save_model(originals[family], tmp_path / family)
        specs.append(f"{out}={FIXTURES / family / 'expected.npz'}")
    reports = run(specs)
    return {Path(r["dir"]).name: r for r in reports}


def _assert_transformers_reports(reports: dict[str, dict]):
    assert sorted(reports) == sorted(FAMILIES)
    for family, r in reports.items():
        # ok: no missing/unexpected/mismatched keys, no config warnings, HF logits within the derived reorder bound
        assert r["ok"], r
    llama = reports["llama"]["rope_parameters"]
    assert llama["rope_type"] == "llama3" and llama["factor"] == 8.0 and llama["rope_theta"] == 10000.0
    assert llama["original_max_position_embeddings"] == 32 and llama["low_freq_factor"] == 1.0
    assert reports["qwen2"]["attention_bias"] == {"q": True, "k": True, "v": True, "o": False}
    assert reports["qwen3"]["attention_bias"] == {"q": False, "k": False, "v": False, "o": False}
    assert reports["mistral"]["sliding_window"] == 6
    assert reports["llama_tied"]["tie_word_embeddings"] is True


def test_transformers_loads_saved_folders_in_process(tmp_path, originals):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_transformers_load", CHECK_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(specs):
        out = []
        for s in specs:
            d, _, npz = s.partition("=")
            out.append(mod.check(Path(d), Path(npz), None, greedy=False))
        return out

    _assert_transformers_reports(_check_with_transformers(run, tmp_path, originals))


@pytest.mark.skipif(not REF_PYTHON.is_file(), reason=f"no reference environment at {REF_PYTHON}")
def test_transformers_loads_saved_folders_via_reference_env(tmp_path, originals):
    def run(specs):
        r = subprocess.run([str(REF_PYTHON), str(CHECK_SCRIPT), "--no-greedy", *specs], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TRANSFORMERS_VERBOSITY": "warning"})
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        assert len(lines) == len(specs), r.stdout + r.stderr
        return lines

    _assert_transformers_reports(_check_with_transformers(run, tmp_path, originals))


def test_hf_config_round_trip_through_model_config(originals):
    for family, model in originals.items():
        assert ModelConfig.from_hf(model.cfg.to_hf()) == model.cfg, family
