"""benchmarks/paged_decode_sweep.py --smoke: tiny shapes, three kernel configs in Pallas interpret mode on the CPU,
each checked against the pure-jnp reference (the sweep returns 1 if any config fails its check)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import paged_decode_sweep  # noqa: E402


def test_sweep_smoke(capsys):
    assert paged_decode_sweep.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count('"ok": true') == 2 * len(paged_decode_sweep.SMOKE_GRID)  # 2 shapes x the smoke configs
    assert "BEST R1-ctx40:" in out and "BEST R3-ctx40:" in out


def test_grid_is_distinct():
    labels = [paged_decode_sweep.label(c) for c in paged_decode_sweep.GRID]
    assert len(set(labels)) == len(labels) and paged_decode_sweep.GRID[0] == paged_decode_sweep.DEFAULT
