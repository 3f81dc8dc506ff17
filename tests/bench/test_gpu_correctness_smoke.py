"""benchmarks/gpu_correctness.py --cpu-smoke runs on a CPU (tiny shapes, cuDNN skipped) and passes: with
torch + transformers installed it compares our losses with HF's; without them, our bf16 recipe with fp32."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_correctness_cpu_smoke():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "benchmarks/gpu_correctness.py", "--cpu-smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["ok"] and not result["failed"]
    checked = [row for row in result["rows"] if row["part"] == "training" and row["ok"] is not None]
    assert checked and all(row["ok"] for row in checked)
    assert all(row["loss_drop"] > 0 for row in checked)  # the steps did train
