"""Checks that need several devices run in ONE child process with N virtual CPU devices
(`--xla_force_host_platform_device_count`): the test module runs itself as a script in the child, which runs every
check of its CHECKS table and prints the results as one JSON line; the parent fails each parametrized case with
its check's traceback. One start-up (and one set of compiles) per module instead of one per check.

Modules of one device count can share ONE child (SHARED): `shared_child_results` runs the checks of all of them
in one process, once per pytest run (under xdist the workers share it through a locked file), and hands each
module its own {check: result}, so every check still passes or fails under its own test name.

    CHECKS = {"name": fn, ...}   # a check that returns a value (JSON) hands it to the parent as results["name.value"]

    @pytest.fixture(scope="module")
    def child_results():
        return run_child(__file__, devices=8, label="sharding")

    if __name__ == "__main__":
        print_results(CHECKS, devices=8)
"""
from __future__ import annotations

import fcntl
import importlib
import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
MARKER = "CHILD_RESULTS "
# The children compile dozens of tiny programs and run each a few times: LLVM's optimisation of the CPU code is most
# of their compile time and buys nothing here. The comparisons in a child are between two programs compiled with the
# same flag (sharded vs one device, pipelined vs scan; test_pipeline's Trainer losses meet the parent's one-device
# run at rel 1e-4, far above the fp32 rounding either compilation changes), and the HLO-level passes (SPMD
# partitioning, the collectives the tests read in the HLO text) run as before: only code generation is unoptimised.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def child_env(devices: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a CPU child with `devices` virtual devices and the repository importable."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices} {FAST_COMPILE}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def _child(argv: list[str], *, devices: int, label: str, env: Mapping[str, str] | None, timeout: float) -> dict:
    """Run `argv` (after the interpreter) in a child with `devices` devices -> its printed results, or
    {"error": message} when it dies or prints none."""
    proc = subprocess.run([sys.executable, *argv], env=child_env(devices, env), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode or not lines:
        return {"error": f"{label} child failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"}
    return {"results": json.loads(lines[-1][len(MARKER):])}


def run_child(script: str, *, devices: int, label: str, env: Mapping[str, str] | None = None,
              timeout: float = 600) -> dict[str, str]:
    """Run `script` in a child with `devices` devices -> {check name: "ok" or its traceback}; a child that dies or
    prints no results fails the calling fixture with its output."""
    out = _child([os.path.abspath(script)], devices=devices, label=label, env=env, timeout=timeout)
    if "error" in out:
        pytest.fail(out["error"])
    return out["results"]


# device count -> the test modules whose CHECKS run in one shared child of that many devices
SHARED = {8: ("tests.parallel.test_sharding", "tests.parallel.test_zero", "tests.parallel.test_expert_parallel",
              "tests.train.test_sharded_training", "tests.train.test_expert_parallel_training",
              "tests.train.test_distill_training")}


def shared_child_results(tmp_path_factory: pytest.TempPathFactory, module_file: str, devices: int,
                         timeout: float = 900) -> dict[str, str]:
    """{check name: "ok" or its traceback} of `module_file`'s CHECKS, from the one child (per pytest run) that runs
    the CHECKS of every module in SHARED[devices]. The first module to ask starts it; under xdist the others (in
    any worker) wait on a lock and read its results from a file in the run's shared temporary directory. A child
    that dies fails every module's fixture with its output."""
    base, run_id = tmp_path_factory.getbasetemp(), os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id:  # xdist: each worker's basetemp is a folder of this run's shared one
        base = base.parent
    path = base / f"virtual-devices-{devices}-{run_id or 'local'}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            out = _child([os.path.abspath(__file__), str(devices)], devices=devices,
                         label=f"shared {devices}-device", env=None, timeout=timeout)
            path.write_text(json.dumps(out))
        out = json.loads(path.read_text())
    if "error" in out:
        pytest.fail(out["error"])
    return out["results"][Path(module_file).stem]


def run_checks(checks: Mapping[str, Callable[[], None]], devices: int) -> dict[str, str]:
    """In the child: every check, each one's failure caught and kept as its traceback; a value a check returns is
    kept as results[f"{name}.value"] (for the parent to compare with what it computed itself)."""
    import jax

    results = {}
    for name, fn in checks.items():
        try:
            assert len(jax.devices()) == devices, f"child sees {len(jax.devices())} devices, expected {devices}"
            value = fn()
            results[name] = "ok"
            if value is not None:
                results[f"{name}.value"] = value
        except Exception:  # reported to the parent, which fails that case with the traceback
            results[name] = traceback.format_exc()
    return results


def print_results(checks: Mapping[str, Callable[[], None]], devices: int) -> None:
    print(MARKER + json.dumps(run_checks(checks, devices)), flush=True)


def check_passed(results: Mapping[str, str], name: str, where: str) -> None:
    if results[name] != "ok":
        pytest.fail(f"{name} failed on {where}:\n{results[name]}", pytrace=False)


def run_shared(devices: int) -> None:
    """In the shared child: every module's checks, one JSON line {module stem: {check: result}}."""
    results = {}
    for name in SHARED[devices]:
        module = importlib.import_module(name)
        results[name.rsplit(".", 1)[-1]] = run_checks(module.CHILD_CHECKS, devices)
    print(MARKER + json.dumps(results), flush=True)


if __name__ == "__main__":
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    run_shared(int(sys.argv[1]))
