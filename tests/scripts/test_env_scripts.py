"""scripts/run.sh, test.sh and env.sh, run against a fake environment (SUROJAX_VENV): a stub `python` that
records its arguments and working directory, so no virtual environment is built and nothing is installed."""

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

STUB_PYTHON = """#!/usr/bin/env bash
# Records each call; `-m pip install` fails when FAIL_PIP is set, so the failure path can be exercised.
echo "cwd=$PWD argv=$*" >> "$STUB_LOG"
if [ "$1 $2 $3" = "-m pip install" ] && [ -n "$FAIL_PIP" ]; then echo "ERROR: no matching distribution" >&2; exit 1; fi
exit 0
"""


def _digest() -> str:
    """What env.sh stamps an install with: the sha256 of pyproject.toml followed by constraints.txt."""
    return hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes()).hexdigest()


def _fake_venv(root: Path, stamp: str | None) -> Path:
    """A directory shaped like a virtual environment: bin/python (the stub), bin/activate, and optionally the
    install stamp (`stamp` names its suffix: "" for the base install, "-dev" for the dev extras)."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(STUB_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    if stamp is not None:
        (venv / f".surojax-installed{stamp}").write_text(_digest() + "\n")
    return venv


def _run(tmp_path, script: str, *, stamp: str | None = "", fail_pip: bool = False):
    venv = _fake_venv(tmp_path, stamp)
    log = tmp_path / "calls.log"
    log.touch()
    env = {**os.environ, "SUROJAX_VENV": str(venv), "STUB_LOG": str(log), "FAIL_PIP": "1" if fail_pip else ""}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return done, log.read_text().splitlines(), venv


def test_run_sh_forwards_arguments_to_the_trainer_only(tmp_path):
    done, calls, _ = _run(tmp_path, f"bash {REPO}/scripts/run.sh --override stages.0.max_steps=100")
    assert done.returncode == 0, done.stderr
    assert calls == [f"cwd={REPO} argv=-m surojax.train --config configs/quickstart.yaml "
                     "--override stages.0.max_steps=100"]


def test_test_sh_uses_dev_extras_and_forwards_arguments_to_pytest(tmp_path):
    done, calls, _ = _run(tmp_path, f"bash {REPO}/scripts/test.sh tests/cli -k help", stamp="-dev")
    assert done.returncode == 0, done.stderr
    assert calls == [f"cwd={REPO} argv=-m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests/cli -k help"]


def test_sourcing_env_sh_keeps_the_callers_directory_and_options(tmp_path):
    done, calls, venv = _run(tmp_path, f'source {REPO}/scripts/env.sh; echo "$? $PWD $-"; command -v python')
    assert done.returncode == 0, done.stderr
    status, pwd, options = done.stdout.splitlines()[0].split(" ")
    assert (status, pwd) == ("0", str(tmp_path))
    assert "e" not in options
    assert done.stdout.splitlines()[1] == str(venv / "bin" / "python")
    assert calls == []  # stamp up to date: nothing installed


@pytest.mark.parametrize("argument", ["--override", "stages.0.max_steps=1"])
def test_env_sh_refuses_an_argument_that_is_not_an_extras_name(tmp_path, argument):
    done, calls, venv = _run(tmp_path, f"source {REPO}/scripts/env.sh {argument}")
    assert done.returncode == 1
    assert f"'{argument}' is not an extras name" in done.stderr
    assert calls == []
    assert sorted(p.name for p in venv.iterdir()) == [".surojax-installed", "bin"]


def test_failed_install_says_what_failed_and_leaves_no_stamp(tmp_path):
    # An up-to-date base stamp: a failed dev install may have half-replaced the packages it vouched for.
    done, calls, venv = _run(tmp_path, f"source {REPO}/scripts/env.sh dev", stamp="", fail_pip=True)
    assert done.returncode == 1
    assert "pip install -c constraints.txt -e" in done.stderr and "failed" in done.stderr
    assert "the next run retries" in done.stderr
    assert "ERROR: no matching distribution" in done.stderr  # pip's own words are shown
    assert calls == [f"cwd={tmp_path} argv=-m pip install -q -c {REPO}/constraints.txt -e {REPO}[dev]"]
    assert not list(venv.glob(".surojax-installed*"))


def test_an_outdated_stamp_is_replaced_after_a_successful_install(tmp_path):
    done, calls, venv = _run(tmp_path, f"echo old > $SUROJAX_VENV/.surojax-installed-dev; "
                                       f"source {REPO}/scripts/env.sh dev", stamp=None)
    assert done.returncode == 0, done.stderr
    assert [c.split(" argv=")[1] for c in calls] == [
        f"-m pip install -q -c {REPO}/constraints.txt -e {REPO}[dev]", "-c import surojax, jax, flax"]
    assert (venv / ".surojax-installed-dev").read_text().strip() == _digest()
