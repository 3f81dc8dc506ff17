"""benchmarks/campaigns/moe_h200.py's parent side without running anything: which child lines count as results, and the
table (ratios to the same-job anchor and to the bf16 base, a reduced depth said out loud, skipped items kept)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("moe_h200", ROOT / "benchmarks/campaigns/moe_h200.py")
moe_h200 = importlib.util.module_from_spec(spec)
sys.modules["moe_h200"] = moe_h200  # its dataclass looks its module up there
spec.loader.exec_module(moe_h200)


def test_parse_result_takes_result_lines_and_gmm_timings_only():
    assert moe_h200.parse_result('RESULT {"tokens_per_s": 5.0}') == {"tokens_per_s": 5.0}
    assert moe_h200.parse_result('{"bench": "grouped_matmul", "kind": "check", "ok": true}') is None
    assert moe_h200.parse_result('{"bench": "grouped_matmul", "kind": "time", "path": "pallas"}')["path"] == "pallas"
    assert moe_h200.parse_result('{"tokens_per_s": 5.0}') is None  # a log line that merely looks like JSON


def test_table_ratios_and_reduced_depth():
    job = moe_h200.job_of(moe_h200.argparse.Namespace(tiny=False, layers=12, batch=2, seq=2048, steps=5, repeats=2,
                                                      lora_targets=moe_h200.ATTENTION_TARGETS))
    rows = [{"item": "hf-anchor", "tokens_per_s": 1000.0, "step_ms": 4096.0, "peak_gib": 90.0},
            {"item": "ours-lora", "tokens_per_s": 3500.0, "step_ms": 1170.0, "mfu": 0.3, "mfu_6n": 0.4,
             "peak_gib": 80.0, "config": {"lora_targets": ["q_proj"], "layer_loop": "recompute none"}},
            {"item": "ours-qlora-nf4", "tokens_per_s": 2800.0, "step_ms": 1460.0, "config": {}},
            {"item": "serve", "skipped": "--layers: the serving item runs the full shape only"}]
    text = moe_h200.table(rows, job, 100.0)
    assert "12 layers (REDUCED DEPTH)" in text
    ours = next(line for line in text.splitlines() if line.startswith("ours-lora"))
    assert "3.50x" in ours and "30.0%" in ours and "40.0%" in ours
    assert "0.80x the bf16 base" in text
    assert "skipped: --layers" in text
