"""Read a jax.profiler trace directory and sum its GPU kernels (shared by the profiling scripts: profile_step.py
for a training step, serve_load.py --profile for the serving engine).

    kernels, events, gpu_pids = gpu_kernels(trace_dir)
    by_name, by_cat, total, devices = kernel_sums(kernels, divide=steps, category=category)
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
from pathlib import Path


def trace_file(trace_dir: str | Path) -> str | None:
    """The perfetto trace (*.trace.json.gz) jax.profiler.trace(..., create_perfetto_trace=True) wrote, or None."""
    files = glob.glob(str(Path(trace_dir) / "**" / "*.trace.json.gz"), recursive=True)
    return files[0] if files else None


def gpu_kernels(path: str) -> tuple[list[dict], list[dict], set]:
    """(the GPU kernel events with a duration, every event, the GPU process ids) of one perfetto trace file."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M"
            and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in pids.items() if "/device:GPU" in name or "GPU" in name.upper()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    return kernels, events, gpu_pids


def kernel_sums(kernels: list[dict], *, divide: float, category) -> tuple[collections.Counter, collections.Counter,
                                                                          float, int]:
    """(µs by kernel name, µs by category(name), total µs, GPUs), each divided by `divide` (steps, tokens) and by
    the number of GPUs that ran kernels (figures per GPU)."""
    by_name, by_cat, total = collections.Counter(), collections.Counter(), 0.0
    devices = max(len({e["pid"] for e in kernels}), 1)
    for e in kernels:
        d = float(e["dur"]) / divide / devices
        by_name[e["name"]] += d
        by_cat[category(e["name"])] += d
        total += d
    return by_name, by_cat, total, devices
