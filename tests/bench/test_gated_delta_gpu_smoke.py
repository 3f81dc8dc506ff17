"""benchmarks/gated_delta_gpu.py's plumbing on the CPU: one tiny packed shape with an initial state, one Pallas
variant (interpret mode, two value-column blocks) and pallas_v2 at its default knobs (its three kernels also timed
one at a time), each checked against the fp32 chunked reference (o of both programs and
every gradient) and timed, then the table. (`--smoke` runs the same plus the chunked form and the token-by-token
reference; here without them, to stay within a few seconds.)"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gated_delta_gpu as bench  # noqa: E402


def test_one_shape_checks_times_and_tabulates(capsys):
    shape = bench.Shape("tiny", 1, 100, 2, 1, Dk=16, Dv=32, segments=2, with_state=True)
    job = bench.Job(None)
    args = argparse.Namespace(workers=2, iters=1, repeats=1, impls=["pallas", "pallas_v2", "fla"])
    bench.run_shape(job, shape, ["bv16-w4-s1"], args, interpret=True, v2_variants=[bench.V2_DEFAULT])  # no fla
    checks = [r for r in job.rows if r["kind"] == "check"]  # where with_state
    # o (of each program) and d(q, k, v, g, beta, initial state), per implementation
    assert len(checks) == 16 and all(r["ok"] for r in checks), checks
    assert job.failed == 0
    v2 = f"pallas_v2:{bench.V2_DEFAULT}"
    timed = {(r["impl"], r["program"]) for r in job.rows if r["kind"] == "time"}
    assert timed == {(impl, p) for impl in ("pallas:bv16-w4-s1", v2) for p in ("fwd", "fwd+bwd")}
    assert {r["part"] for r in job.rows if r["kind"] == "part"} == {
        "prepare", "wy", "state", "output",  # the forward's kernels, then the backward's four and both backwards
        "bwd_wy_t", "bwd_state", "bwd_dqkw", "bwd_wy_bwd", "bwd_kernels", "bwd_jnp"}
    table = bench.table(job.rows)
    assert "pallas:bv16-w4-s1" in table and v2 in table and "FAIL" not in table and "ERROR" not in table
    assert bench.parse_variant(bench.DEFAULT_VARIANT) == (bench.BLOCK_V, bench.NUM_WARPS, bench.NUM_STAGES)
