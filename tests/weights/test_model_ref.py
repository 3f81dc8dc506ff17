"""surojax.weights.model_ref: what each kind of reference resolves to (no weights read), the config dict of any
reference, and refusals that name the path and what was expected."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from surojax.hub import ModelNotFoundError
from surojax.weights.model_ref import ModelRef, ModelRefError, hf_config_of, resolve_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "models" / "qwen3"
GGUF_FILE = b"GGUF"  # resolution looks at names and files only; a .gguf is not opened


def adapter_dir(path: Path, base, tokenizer: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    if tokenizer:
        shutil.copy(FIXTURE / "tokenizer.json", path / "tokenizer.json")
    return path


def test_hf_folder_and_run_folders(tmp_path):
    assert resolve_model(FIXTURE) == ModelRef("hf", FIXTURE, None, FIXTURE, str(FIXTURE))
    for sub in ("model", "merged"):
        shutil.copytree(FIXTURE, tmp_path / sub / "run" / sub)
        r = resolve_model(tmp_path / sub / "run")
        assert (r.kind, r.weights, r.adapter, r.tokenizer_dir) == ("hf", tmp_path / sub / "run" / sub, None,
                                                                    tmp_path / sub / "run" / sub)
        assert r.name == "run"


def test_adapter_folder_and_run_folder_holding_one(tmp_path):
    a = adapter_dir(tmp_path / "run" / "adapter", str(FIXTURE))
    for ref in (tmp_path / "run", a):
        r = resolve_model(ref)
        assert (r.kind, r.weights, r.adapter, r.tokenizer_dir) == ("hf", FIXTURE, a, FIXTURE)
    b = adapter_dir(tmp_path / "own_tok", str(FIXTURE), tokenizer=True)
    assert resolve_model(b).tokenizer_dir == b  # the adapter's own tokenizer copy first


def test_gguf_file_and_an_adapter_over_it(tmp_path):
    f = tmp_path / "m.Q4_K_M.gguf"
    f.write_bytes(GGUF_FILE)
    assert resolve_model(f) == ModelRef("gguf", f, None, None, str(f))
    assert resolve_model(f).name == "m.Q4_K_M"
    a = adapter_dir(tmp_path / "a", str(f), tokenizer=True)
    assert resolve_model(a) == ModelRef("gguf", f, a, a, str(a))


def test_repo_id_in_the_local_cache(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("cd" * 20)
    shutil.copytree(FIXTURE, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text(snap.name)  # the layout huggingface_hub writes
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache only (tests/test_hub.py fetches from a stand-in Hub)
    r = resolve_model("org/tiny")
    assert (r.kind, r.weights, r.source) == ("hf", snap, "org/tiny")
    with pytest.raises(ModelNotFoundError, match="org/absent"):
        resolve_model("org/absent")


def test_refusals_name_the_path_and_what_was_expected(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "w.bin").write_bytes(b"x")
    for ref, want in ((tmp_path / "empty", "holds no config.json"), (tmp_path / "w.bin", "not a .gguf file"),
                      (tmp_path / "no.gguf", "does not exist")):
        with pytest.raises(ModelRefError) as e:
            resolve_model(ref)
        assert want in str(e.value) and str(ref) in str(e.value) and "expected" in str(e.value)
    with pytest.raises(ModelRefError, match="no base_model_name_or_path"):
        resolve_model(adapter_dir(tmp_path / "nobase", None))
    inner = adapter_dir(tmp_path / "inner", str(FIXTURE))
    with pytest.raises(ModelRefError, match="is itself an adapter"):
        resolve_model(adapter_dir(tmp_path / "outer", str(inner)))
    gone = adapter_dir(tmp_path / "gone", str(tmp_path / "moved_base"))
    with pytest.raises(ModelRefError) as e:
        resolve_model(gone)
    assert str(gone / "adapter_config.json") in str(e.value) and str(tmp_path / "moved_base") in str(e.value)


def test_hf_config_of_every_kind(tmp_path):
    want = json.loads((FIXTURE / "config.json").read_text())
    assert hf_config_of(FIXTURE) == want
    assert hf_config_of(adapter_dir(tmp_path / "a", str(FIXTURE))) == want
    pytest.importorskip("gguf")
    from surojax.models.config import ModelConfig
    from surojax.weights.gguf_checkpoint import save_gguf

    path = save_gguf(FIXTURE, tmp_path / "m.gguf", "f32")
    got, ref = ModelConfig.from_hf(hf_config_of(path)), ModelConfig.from_hf(want)
    assert got.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert dataclasses.replace(got, rms_norm_eps=ref.rms_norm_eps, pad_token_id=ref.pad_token_id) == ref
