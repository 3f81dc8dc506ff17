"""Hub ids through the real clients (huggingface_hub, datasets) against a stand-in Hub (tests/hub_endpoint.py).

In-process tests point surojax.hub at the stand-in through HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE, which it
reads when a name is resolved. Hub datasets and the quickstart run in a subprocess: `datasets` reads its endpoint
and offline flag when it is imported, as a user's process does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from huggingface_hub import constants as hf_constants

from surojax.config import ConfigError, check_paths, config_from_dict
from surojax.hub import HubId, ModelNotFoundError, gguf_files, model_path, parse_hub_id
from surojax.model_loader import load_model_ref
from surojax.weights.model_ref import ModelRefError, names_gguf, resolve_model
from tests.hub_endpoint import FIXTURES, StandInHub, finetome_repo, qwen3_repo

ROOT = Path(__file__).resolve().parents[1]
QWEN, FINETOME, LORA = "Qwen/Qwen3-0.6B", "mlabonne/FineTome-100k", "peft-test/tiny-llama-lora"
RUN_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json"}  # what a run needs of qwen3_repo(); never its .bin / onnx / original copies
GGUF = {"tiny-Q4_K_M.gguf": b"q4", "tiny-Q8_0.gguf": b"q8", "mmproj-tiny-Q8_0.gguf": b"mm",
        "Q2_K/tiny-Q2_K-00001-of-00002.gguf": b"part1", "Q2_K/tiny-Q2_K-00002-of-00002.gguf": b"part2"}


@pytest.fixture(scope="module")
def hub():
    h = StandInHub()
    files = qwen3_repo()
    h.commits = {"main": h.add_repo(QWEN, files),
                 "v1": h.add_repo(QWEN, {**files, "generation_config.json": b'{"revision": "v1"}'}, revision="v1")}
    bert = json.loads(files["config.json"]) | {"model_type": "bert"}
    h.add_repo("org/bert", {**files, "config.json": json.dumps(bert).encode()})
    h.add_repo("org/gated", files, gated=True)
    h.add_repo("org/tiny-GGUF", GGUF)
    peft = FIXTURES / "peft"
    tokenizer = {n: files[n] for n in ("tokenizer.json", "tokenizer_config.json")}
    h.add_repo("peft-test/tiny-llama", {p.name: p.read_bytes() for p in (peft / "base").iterdir()} | tokenizer)
    adapter_cfg = json.loads((peft / "adapter" / "adapter_config.json").read_text())
    h.add_repo(LORA, {"adapter_config.json": json.dumps(adapter_cfg | {"base_model_name_or_path":
                                                                         "peft-test/tiny-llama"}).encode(),
                      "adapter_model.safetensors": (peft / "adapter" / "adapter_model.safetensors").read_bytes(),
                      "README.md": b"# an adapter\n"})
    h.add_repo(FINETOME, finetome_repo(), repo_type="dataset")
    with h:
        yield h


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """The stand-in Hub, an empty cache (returned), no offline flag, no token."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # whatever the environment was at import
    return tmp_path / "hub"


def test_what_reads_as_a_hub_id():
    assert parse_hub_id(QWEN) == HubId(QWEN)
    assert parse_hub_id("Qwen/Qwen2.5-0.5B@v1.0") == HubId("Qwen/Qwen2.5-0.5B", "v1.0")
    assert parse_hub_id("org/x-GGUF@refs/pr/3:q4_k_m") == HubId("org/x-GGUF", "refs/pr/3", "q4_k_m")
    assert parse_hub_id("org/data:Q8_0", "dataset") is None  # a quantisation names a GGUF file of a model repo
    for path in ("./org/name", "/org/name", "~/name", "a/b/c", "data/train.jsonl", "models/m.gguf", "gpt2", "org/"):
        assert parse_hub_id(path) is None, path


def test_a_remote_url_is_said_to_be_one(tmp_path):
    # Surogate's dataset path takes s3:// and gs:// URLs; surojax reads local paths and Hub ids
    with pytest.raises(ModelNotFoundError, match="'s3://bucket/m': s3://bucket/m is a URL"):
        model_path("s3://bucket/m")
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError) as e:
        check_paths(config_from_dict({"model": str(FIXTURES / "models" / "qwen3"),
                                      "datasets": [{"path": str(tmp_path / "d.jsonl")}, {"path": "gs://b/train"}]}))
    assert e.value.keys == ["datasets[1].path"] and "gs://b/train is a URL" in str(e.value)


def test_a_model_id_fetches_what_a_run_needs_once_and_a_revision_its_own_commit(hub, online):
    n = len(hub.requests)
    head = resolve_model(QWEN, weights=False)
    assert hub.downloaded(QWEN, n) == RUN_FILES - {"model.safetensors"}  # the config is read before weights
    ref = resolve_model(QWEN)
    assert ref.weights == online / "models--Qwen--Qwen3-0.6B" / "snapshots" / hub.commits["main"] == head.weights
    assert hub.downloaded(QWEN, n) == RUN_FILES and ref.name == QWEN
    exp = np.load(FIXTURES / "models" / "qwen3" / "expected.npz")
    model = load_model_ref(QWEN).model
    got = np.asarray(model(exp["tokens2"][None]))[0]
    assert np.abs(got - exp["logits2"]).max() <= 1e-4  # the fixture's transformers logits
    n = len(hub.requests)
    assert resolve_model(QWEN) == ref and len(hub.requests) == n  # resolved once per process
    v1 = resolve_model(f"{QWEN}@v1", weights=False).weights
    assert v1.name == hub.commits["v1"] and json.loads((v1 / "generation_config.json").read_text()) == {
        "revision": "v1"}


def test_bad_ids_fail_on_the_head_files_naming_the_id_and_why(hub, online, tmp_path, monkeypatch):
    for name, why in (("Qwen/Nope", "no such local path, and no such model repo on the Hub"),
                      (f"{QWEN}@v9", "has no revision 'v9'"),
                      ("org/gated", r"gated \(HTTP 401\).*HF_TOKEN"),
                      ("org/bert", "model_type 'bert' is not supported")):
        with pytest.raises((ModelNotFoundError, ModelRefError), match=why) as e:
            resolve_model(name)
        assert name in str(e.value)
    assert "model.safetensors" not in hub.downloaded("org/bert")  # refused before its weights
    monkeypatch.setenv("HF_TOKEN", hub.TOKEN)  # the client sends it
    assert resolve_model("org/gated").weights.parents[1] == online / "models--org--gated"
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError) as e:
        check_paths(config_from_dict({"model": "Qwen/Nope", "datasets": [{"path": str(tmp_path / "d.jsonl")}]}))
    assert e.value.keys == ["model"] and "'Qwen/Nope'" in str(e.value)


def test_offline_reads_the_cache_revision_honoured_or_says_why(hub, online, monkeypatch):
    ref = resolve_model(QWEN)
    resolve_model(f"{QWEN}@v1", weights=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(hub.requests)
    assert resolve_model(QWEN) == ref
    assert resolve_model(f"{QWEN}@v1", weights=False).weights.name == hub.commits["v1"]
    with pytest.raises(ModelNotFoundError, match=r"offline \(HF_HUB_OFFLINE is set\).*lacks files.*model.safetensors"):
        resolve_model(f"{QWEN}@v1")  # v1's weights were never fetched
    with pytest.raises(ModelNotFoundError, match=rf"'org/bert': offline \(HF_HUB_OFFLINE is set\) and revision "
                                                 rf"'main' is not in the cache {online}"):
        resolve_model("org/bert")
    assert len(hub.requests) == n
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # no flag, but no network: the cache all the same
    assert resolve_model(QWEN) == ref
    with pytest.raises(ModelNotFoundError, match=r"'org/bert': the Hub at http://127.0.0.1:9 cannot be reached"):
        resolve_model("org/bert")


def test_a_gguf_quantisation_fetches_its_files_only(hub, online):
    assert names_gguf("org/tiny-GGUF:Q2_K") and not names_gguf(QWEN)
    assert gguf_files("org/tiny-GGUF:q8_0") == ["tiny-Q8_0.gguf"]  # not the mmproj file
    n = len(hub.requests)
    path = model_path("org/tiny-GGUF:q2_k")
    assert path.name == "tiny-Q2_K-00001-of-00002.gguf" and path.read_bytes() == b"part1"
    assert hub.downloaded("org/tiny-GGUF", n) == {"Q2_K/tiny-Q2_K-00001-of-00002.gguf",
                                                      "Q2_K/tiny-Q2_K-00002-of-00002.gguf"}
    with pytest.raises(ModelNotFoundError, match="no GGUF file matches 'Q5_K'.*tiny-Q4_K_M.gguf"):
        model_path("org/tiny-GGUF:Q5_K")
    with pytest.raises(ModelRefError, match="name one as org/tiny-GGUF:QUANT"):
        resolve_model("org/tiny-GGUF")


def test_an_adapter_repo_naming_a_hub_base_gives_peft_logits(hub, online):
    exp = np.load(FIXTURES / "peft" / "expected.npz")
    loaded = load_model_ref(LORA)
    assert loaded.ref.adapter.name == hub.repos[("model", LORA)].refs["main"]  # both from the HF cache
    assert loaded.ref.weights.parents[1] == online / "models--peft-test--tiny-llama"
    assert hub.downloaded(LORA) >= {"adapter_config.json", "adapter_model.safetensors"}
    assert "README.md" not in hub.downloaded(LORA)
    np.testing.assert_allclose(np.asarray(loaded.model(exp["tokens"])), exp["logits"], rtol=0, atol=1e-4)


# ---- a user's process: `python -m surojax.train` ------------------------------------------------------------------

def _train(config: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "surojax.train", "--config", str(config)]
    for o in overrides:
        cmd += ["-o", o]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _env(hub_url: str, home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE",
                        "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE")}
    return env | {"HF_ENDPOINT": hub_url, "HF_HOME": str(home), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                  "XLA_FLAGS": "--xla_backend_optimization_level=0"} | extra


def test_the_hub_quickstart_trains_from_the_hub_then_offline_from_the_cache(hub, tmp_path):
    """configs/examples/hub_quickstart.yaml as written (model Qwen/Qwen3-0.6B, dataset mlabonne/FineTome-100k),
    sized down; the second run has HF_HUB_OFFLINE=1 and no Hub at all (its endpoint is a closed port)."""
    small = ("recipe=fp32", "sequence_len=64", "max_steps=2", "per_device_train_batch_size=2",
             "gradient_accumulation_steps=1")
    config = ROOT / "configs" / "examples" / "hub_quickstart.yaml"
    n = len(hub.requests)
    first = _train(config, _env(hub.url, tmp_path / "hf"), f"output_dir={tmp_path / 'online'}", *small)
    assert first.returncode == 0, first.stderr[-3000:]
    assert hub.downloaded(QWEN, n) == RUN_FILES
    assert hub.downloaded(FINETOME, n) >= {"data/train-00000-of-00001.parquet"}
    adapter = json.loads((tmp_path / "online" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == QWEN  # the adapter names its base by the Hub id

    n = len(hub.requests)
    closed = "http://127.0.0.1:9"  # nothing listens there: the Hub is unreachable
    second = _train(config, _env(closed, tmp_path / "hf", HF_HUB_OFFLINE="1"), f"output_dir={tmp_path / 'offline'}",
                    *small)
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(hub.requests) == n
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(line)] for d in ("online", "offline")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]  # the same model, data and steps


def test_hub_datasets_rows_and_problems(hub, tmp_path):
    """A missing split / subset / repo / revision and, offline, an id that is not cached: one error per key from
    the config check (no model loaded, no data read); rows are named by id, split and row."""
    cfg = {"model": QWEN, "lora": True, "output_dir": str(tmp_path / "out"),
           "datasets": [{"path": FINETOME, "split": "test"}, {"path": FINETOME, "subset": "chat"},
                        {"path": "mlabonne/FineTome-1M"}, {"path": f"{FINETOME}@v9"}]}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    # one child for the config check and the rows (the same Hub and HF_HOME): `python -m surojax.train`'s main, its
    # exit status printed, then read_rows
    child = ("import json; from surojax.cli.train_script import main; "
             f"print('RC', main(['--config', {str(tmp_path / 'bad.yaml')!r}]), flush=True); "
             "from surojax.data.sources import read_rows as r; print(json.dumps("
             f"[w for w, _ in r('{FINETOME}', samples=2)] + "
             f"[w for w, _ in r('{FINETOME}', data_files={{'train': 'data/*.parquet'}}, samples=1)]))")
    r = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=_env(hub.url, tmp_path / "hf"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RC 1" in r.stdout.splitlines(), r.stdout + r.stderr[-3000:]  # the bad config: exit status 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 4, r.stderr[-3000:]
    for i, (error, want) in enumerate(zip(errors, (
            f"dataset '{FINETOME}': no split 'test' (splits: train); set `split:`",
            f"dataset '{FINETOME}': no subset 'chat'",
            "dataset 'mlabonne/FineTome-1M': no such local path, and Dataset 'mlabonne/FineTome-1M' doesn't exist",
            f"dataset '{FINETOME}@v9': Revision 'v9' doesn't exist"))):
        assert f"datasets[{i}].path: {want}" in error, error
    assert json.loads(r.stdout.splitlines()[-1]) == [f"{FINETOME}[train]:row 1", f"{FINETOME}[train]:row 2",
                                                     f"{FINETOME}[train]:row 1"]

    cfg["datasets"] = [{"path": FINETOME}]
    (tmp_path / "offline.yaml").write_text(yaml.safe_dump(cfg))
    r = _train(tmp_path / "offline.yaml", _env(hub.url, tmp_path / "empty", HF_HUB_OFFLINE="1"))
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"model: model '{QWEN}': offline (HF_HUB_OFFLINE is set) and revision 'main' is not in the cache" in r.stderr
    assert f"datasets[0].path: dataset '{FINETOME}': offline" in r.stderr and "not in the datasets cache" in r.stderr
