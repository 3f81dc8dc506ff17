"""benchmarks/campaigns/multi_gpu_h200.py's arithmetic: scaling against the part's 1-GPU row, the bubble from two microbatch
counts (the campaign itself runs on a multi-GPU host; `--smoke` runs its plumbing on CPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "campaigns"))
from multi_gpu_h200 import add_bubble, add_scaling, parts  # noqa: E402


def test_scaling_is_per_gpu_throughput_over_the_one_gpu_row():
    rows = [{"gpus": 1, "tokens_per_s": 100.0}, {"gpus": 2, "tokens_per_s": 190.0}, {"gpus": 2, "error": "oom"}]
    add_scaling(rows)
    assert rows[0]["scaling"] == 1.0 and rows[1]["scaling"] == pytest.approx(0.95) and "scaling" not in rows[2]


def test_bubble_from_two_microbatch_counts():
    # S = 2 stages, t_mb = 10 ms: t(M) = (M + 1) x 10 -> M=2: 30 ms, M=4: 50 ms; bubble (S-1) t_mb / t(M)
    rows = [{"row": "stage=2 M=2", "step_ms": 30.0}, {"row": "stage=2 M=4", "step_ms": 50.0}]
    add_bubble(rows, stages=2)
    assert rows[0]["microbatch_ms"] == pytest.approx(10.0)
    assert rows[0]["bubble_measured"] == pytest.approx(1 / 3) == rows[0]["bubble_predicted"]
    assert rows[1]["bubble_measured"] == pytest.approx(0.2) == rows[1]["bubble_predicted"]


def test_every_multi_gpu_row_names_its_mesh():
    for part, rows in parts(4, smoke=False).items():
        for name, gpus, argv in rows:
            assert (gpus == 1) == ("--parallel" not in argv), (part, name)
