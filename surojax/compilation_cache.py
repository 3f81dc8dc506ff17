"""JAX's persistent compilation cache, on by default for GPU runs.

An unrolled layer loop (`unroll_layers: true`, which `auto` picks where it fits) compiles every layer into one
program, so its compile time grows with depth where the rolled scan's stays flat (figures: benchmarks/RESULTS.md).
With the cache a second run of the same program (same model shapes, batch, settings, jax / XLA build)
loads the executable, and XLA's per-fusion autotuning results, from disk instead.

    directory   $JAX_COMPILATION_CACHE_DIR when set (JAX's own variable: the user's choice is kept), else
                $SUROJAX_CACHE_DIR, else $XDG_CACHE_HOME/surojax/xla (~/.cache/surojax/xla);
                SUROJAX_CACHE_DIR=off turns it off
    what        executables whose compile took >= 1 s (JAX's `jax_persistent_cache_min_compile_time_secs`
                default), keyed by JAX on the program, the compile options and the backend version
    CPU         left off: its compiles take seconds and the tests and the quickstart should not write to the home

The cache is trusted code: do not point it at a directory others may write to.

Several processes share one directory (the ranks of `surojax launch`, the test suite's workers): JAX's file cache
without a size limit (jax._src.lru_cache.LRUCache.put) writes an entry in place, so a process that looks the same
key up meanwhile can read a truncated executable and crash deserialising it (seen in the CPU suite: a segfault in
get_executable_and_time). `atomic_cache_writes()` (called by `enable_compilation_cache`, and by the tests'
conftest) makes each write a temporary file renamed into place, which readers see whole or not at all.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

ENV_DIR = "SUROJAX_CACHE_DIR"
OFF = ("off", "0", "false", "none")


def default_cache_dir() -> Path | None:
    """Where surojax keeps compiled programs ($SUROJAX_CACHE_DIR, else the XDG cache), None when turned off."""
    env = os.environ.get(ENV_DIR)
    if env is not None:
        return None if env.strip().lower() in OFF or not env.strip() else Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "surojax" / "xla"


def atomic_cache_writes() -> bool:
    """Make JAX's persistent cache write each entry atomically (module docstring); idempotent. -> False where this
    jax has no such cache class (nothing changed)."""
    try:
        from jax._src import lru_cache  # private: guarded, the cache works unpatched where this changes
    except ImportError:
        return False
    cls = getattr(lru_cache, "LRUCache", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if cls is None or suffix is None or not hasattr(cls, "put"):
        return False
    if getattr(cls.put, "surojax_atomic", False):
        return True
    in_place = cls.put

    def put(self, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True) or not getattr(self, "_is_local", False) or not key:
            return in_place(self, key, value)  # the locked (size-limited) or remote path: JAX's own
        path = Path(str(self.path)) / f"{key}{suffix}"
        if path.exists():
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(value)
        os.replace(tmp, path)

    put.surojax_atomic = True
    cls.put = put
    return True


def enable_compilation_cache(platform: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache for a run on `platform` ("gpu", "cpu", ...; the first device's
    `.platform`); call it before the first compile. Returns the directory in use, or None where the cache stays
    off (CPU, or SUROJAX_CACHE_DIR=off). A directory already set in JAX's config (JAX_COMPILATION_CACHE_DIR)
    is kept; else `cache_dir`, else `default_cache_dir()`."""
    atomic_cache_writes()
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if platform == "cpu":
        return None
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
