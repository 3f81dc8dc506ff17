"""resolve_local: local paths as is, repo ids only through a (fake) local Hugging Face cache."""
from __future__ import annotations

import pytest

from surojax.hub import ModelNotFoundError, hf_hub_cache, resolve_local

COMMIT = "a" * 40
OTHER = "b" * 40


def make_repo(cache, repo_id, commits=(COMMIT,), refs=None, kind="models"):
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    for c in commits:
        (repo / "snapshots" / c).mkdir(parents=True)
        (repo / "snapshots" / c / "config.json").write_text("{}")
    for name, commit in (refs if refs is not None else {"main": commits[0]}).items():
        (repo / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit + "\n")
    return repo


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_local_path_is_returned_as_is(tmp_path, cache):
    d = tmp_path / "my-model"
    d.mkdir()
    assert resolve_local(d) == d
    assert resolve_local(str(d)) == d
    (d / "model.safetensors").write_text("")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_local(d / "model.safetensors")


def test_repo_id_resolves_through_refs_main(cache):
    repo = make_repo(cache, "org/tiny", commits=(COMMIT, OTHER), refs={"main": OTHER, "v1": COMMIT})
    assert resolve_local("org/tiny") == repo / "snapshots" / OTHER
    assert resolve_local("org/tiny", revision="v1") == repo / "snapshots" / COMMIT
    assert resolve_local("org/tiny@v1") == repo / "snapshots" / COMMIT
    assert resolve_local("org/tiny", revision=COMMIT) == repo / "snapshots" / COMMIT


def test_single_snapshot_without_refs(cache):
    repo = make_repo(cache, "org/norefs", refs={})
    assert resolve_local("org/norefs") == repo / "snapshots" / COMMIT


def test_dataset_kind_and_explicit_cache_dir(tmp_path, cache):
    other = tmp_path / "elsewhere"
    repo = make_repo(other, "org/data", kind="datasets")
    assert resolve_local("org/data", kind="dataset", cache_dir=other) == repo / "snapshots" / COMMIT
    with pytest.raises(ModelNotFoundError, match="--repo-type dataset org/data"):
        resolve_local("org/data", kind="dataset")  # not in the default cache
    with pytest.raises(ValueError, match="kind must be"):
        resolve_local("org/data", kind="weights")


def test_miss_is_clear(cache):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_local("meta-llama/Llama-3.2-1B")
    msg = str(e.value)
    assert "'meta-llama/Llama-3.2-1B' was not found locally" in msg
    assert "huggingface-cli download meta-llama/Llama-3.2-1B --local-dir DIR" in msg and "pass DIR" in msg
    assert str(cache) in msg
    assert isinstance(e.value, FileNotFoundError)


def test_unknown_revision_and_missing_snapshot(cache):
    make_repo(cache, "org/a", commits=(COMMIT, OTHER))
    with pytest.raises(ModelNotFoundError, match="revision 'dev' has no refs entry.*snapshots present"):
        resolve_local("org/a", revision="dev")
    make_repo(cache, "org/b", refs={"main": OTHER})  # refs/main points at a snapshot that was never fetched
    with pytest.raises(ModelNotFoundError, match=f"snapshot {OTHER}.*is missing"):
        resolve_local("org/b")


def test_missing_paths_are_not_taken_for_repo_ids(tmp_path, cache):
    for name in (str(tmp_path / "absent"), "./absent", "../x/y", "a/b/c", "~/nothing-here-xyz"):
        with pytest.raises(ModelNotFoundError, match="does not exist"):
            resolve_local(name)


def test_cache_location_follows_huggingface_hub(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hf_hub_cache() == tmp_path / "c"
