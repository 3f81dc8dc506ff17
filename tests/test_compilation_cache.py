"""enable_compilation_cache: which directory JAX's persistent cache gets, and that CPU runs leave it off."""
import os
from pathlib import Path

import jax
import pytest

from surojax.compilation_cache import ENV_DIR, atomic_cache_writes, default_cache_dir, enable_compilation_cache


@pytest.fixture
def jax_cache_dir(monkeypatch):
    """JAX's cache directory unset for the test, restored afterwards; no cache variable from the environment."""
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv(ENV_DIR, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_gpu_run_sets_the_cache_dir(jax_cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "xla"))
    assert enable_compilation_cache("gpu") == tmp_path / "xla"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert (tmp_path / "xla").is_dir()


def test_cpu_run_and_off_leave_it_unset(jax_cache_dir, tmp_path, monkeypatch):
    assert enable_compilation_cache("cpu", tmp_path) is None
    monkeypatch.setenv(ENV_DIR, "off")
    assert default_cache_dir() is None and enable_compilation_cache("gpu") is None
    assert jax.config.jax_compilation_cache_dir is None


def test_default_dir_and_users_jax_dir_kept(jax_cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "surojax" / "xla"
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # JAX_COMPILATION_CACHE_DIR's effect
    assert enable_compilation_cache("gpu", tmp_path / "other") == tmp_path / "mine"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


def test_cache_entries_are_written_whole(tmp_path, monkeypatch):
    """JAX's unlimited file cache with atomic_cache_writes: an entry appears under its name only whole (written to
    a temporary file, then renamed: a reader never sees it half written), the first writer's value is kept, and no
    temporary file stays behind."""
    from jax._src import lru_cache

    assert atomic_cache_writes() and atomic_cache_writes()  # idempotent
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    seen = []
    real_replace = os.replace

    def replace(src, dst):  # the entry's name does not exist until the rename
        seen.append((Path(dst).exists(), Path(src).read_bytes()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    cache.put("k", b"x" * 1000)
    cache.put("k", b"other")
    assert seen == [(False, b"x" * 1000)] and cache.get("k") == b"x" * 1000
    assert [p.name for p in tmp_path.iterdir()] == [f"k{lru_cache._CACHE_SUFFIX}"]
