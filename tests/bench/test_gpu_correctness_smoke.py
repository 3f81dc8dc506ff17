"""benchmarks/gpu_correctness.py --cpu-smoke runs on a CPU (tiny shapes, cuDNN skipped) and passes: with
torch + transformers installed it compares our losses with HF's; without them, our bf16 recipe with fp32.

The script's own `main()` with its command line, in this process: nothing here needs a process of its own, and a
new interpreter would import jax (and torch) again."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_correctness_cpu_smoke(capsys, monkeypatch):
    import jax

    assert jax.default_backend() == "cpu"
    # the script sets this at import; keep this process's environment as it was afterwards
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("gpu_correctness_smoke_run", ROOT / "benchmarks/gpu_correctness.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["gpu_correctness.py", "--cpu-smoke"])
    rc = script.main()
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert result["ok"] and not result["failed"]
    checked = [row for row in result["rows"] if row["part"] == "training" and row["ok"] is not None]
    assert checked and all(row["ok"] for row in checked)
    assert all(row["loss_drop"] > 0 for row in checked)  # the steps did train
