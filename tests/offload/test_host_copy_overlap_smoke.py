"""benchmarks/host_copy_overlap.py on the CPU: every variant runs at tiny shapes and equals the resident loop;
the trace analysis counts host-to-device copies, their streams and their overlap with compute kernels."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_copy_overlap.py"


def _load():
    spec = importlib.util.spec_from_file_location("host_copy_overlap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _load()


def test_every_variant_matches_resident(script, capsys):
    results = {r["variant"]: r for r in script.main(["--smoke"])}
    assert {"resident", "copy-only", "copy-only-list", "scan-dynamic-slice", "scan-prefetch", "list-unrolled",
            "eager-pipelined"} <= set(results)
    ran = {name: r for name, r in results.items() if "error" not in r}
    # the forms surojax uses and the baselines must run; experimental APIs (compute_on) may report an error
    assert {"resident", "copy-only", "scan-dynamic-slice", "scan-prefetch", "list-unrolled"} <= set(ran)
    for name, r in ran.items():
        assert r["max_abs_diff"] == 0.0, (name, r)
        assert r["check"] == "exact", (name, r)
        assert r["ms"] > 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("ms: median per call")   # the table is last


def _trace(events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "Stream #9(MemcpyH2D)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "XLA Ops"}}]
    return meta + [dict(ph="X", pid=1, tid=tid, name=name, ts=ts, dur=dur) for tid, name, ts, dur in events]


def test_trace_analysis_overlap_and_streams(script):
    events = _trace([
        (7, "gemm_fusion", 0.0, 1000.0),                    # compute 0..1 ms
        (7, "wrapped_dynamic_slice_1", 1000.0, 500.0),      # a copy kernel on the compute stream, serial
        (9, "MemcpyH2D", 500.0, 1000.0),                    # a DMA on its own stream, half under the gemm
        (3, "gemm_fusion", 0.0, 5000.0),                    # an XLA Ops summary row: ignored
    ])
    r = script.analyse_trace(events, calls=1)
    assert r["device_events"] == 3
    assert r["h2d_per_call"] == 1 and r["h2d_ms"] == pytest.approx(1.0)
    assert r["h2d_overlap_pct"] == pytest.approx(50.0)
    assert r["h2d_other_stream"] is True
    assert r["dslice_ms"] == pytest.approx(0.5) and r["dslice_overlap_pct"] == 0.0
    assert r["dslice_other_stream"] is False
    assert r["compute_ms"] == pytest.approx(1.0) and r["wall_ms"] == pytest.approx(1.5)


def test_trace_analysis_copy_row_names_the_copy(script):
    """An event on a row of host-to-device copies counts as one even when named after its HLO op."""
    r = script.analyse_trace(_trace([(7, "gemm", 0.0, 100.0), (9, "copy-start.3", 0.0, 50.0)]), calls=1)
    assert r["h2d_per_call"] == 1 and r["h2d_overlap_pct"] == pytest.approx(100.0) and r["compute_ms"] == 0.1


def test_trace_analysis_without_device_events(script):
    assert script.analyse_trace([{"ph": "X", "pid": 5, "name": "x", "ts": 0, "dur": 1}], calls=1) == {
        "device_events": 0}
