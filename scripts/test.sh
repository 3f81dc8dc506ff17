#!/usr/bin/env bash
# The test suite (CPU): set up the environment with the dev extras if needed, then run pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/cli
cd "$(dirname "$0")/.." || exit 1
source scripts/env.sh dev || exit 1
export JAX_PLATFORMS=cpu
# One persistent XLA compilation cache for this run, shared by both workers and every subprocess the tests start
# (a training run, a CLI call, a resume): a program compiled once (the same tiny model's step, generate, forward)
# is loaded from disk instead of compiled again. A fresh directory each run, removed at the end; a directory the
# caller exports is kept as given.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d)" || exit 1
  export JAX_COMPILATION_CACHE_DIR
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
# Only programs whose compile took >= 1 s (JAX's default; the training steps and CLI runs the subprocess tests share):
# with every program cached (threshold 0) two fresh-clone runs of 2026-12-06 each lost a worker to a segfault
# inside XLA's executable (de)serialisation of a small program (a forward, a prefill), and xdist then hung (the
# crash: scripts/test_chunks.py; the hang: tests/conftest.py).
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# LLVM at -O0 for the CPU backend: the tests' tiny programs spend most of their time compiling, not running, and
# LLVM's optimisation passes and instruction selection are a large part of each compile. Same HLO (XLA's own passes
# still run), IEEE semantics kept (no fast-math). Measured on the whole suite, fresh clone, 2 cores (2026-12-02):
# 753 s at -O1, 538 s at -O0, every test passing (-O1 had replaced -O2 before, -25%). Children started with their
# own XLA_FLAGS keep -O2 unless they append to it, as tests/parallel/virtual_devices.py does.
export XLA_FLAGS="--xla_backend_optimization_level=0${XLA_FLAGS:+ $XLA_FLAGS}"
# Whole modules per worker (module fixtures built once), handed out slowest first (tests/conftest.py orders them
# by tests/module_seconds.txt; --no-loadscope-reorder keeps that order instead of xdist's "most tests first").
# The whole suite (no arguments) runs as CHUNKS pytest runs over groups of modules of about equal measured time,
# each with fresh workers: scripts/test_chunks.py says why (a native crash that grows with a worker's lifetime).
PYTEST=(python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder)
if [ "$#" -gt 0 ]; then
  "${PYTEST[@]}" "$@"
  exit
fi
mapfile -t groups < <(python scripts/test_chunks.py "${SUROJAX_TEST_CHUNKS:-3}") || exit 1
status=0
for group in "${groups[@]}"; do
  read -r -a modules <<< "$group"
  "${PYTEST[@]}" "${modules[@]}" < /dev/null || status=1
done
exit "$status"
