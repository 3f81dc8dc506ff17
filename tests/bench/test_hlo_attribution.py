"""benchmarks/hlo_attribution.py: kernels of a profiled step joined to the source lines that traced them, through
the optimized HLO's metadata (op_name + stack frames). On a small compiled function: the dot's instruction maps
to the line of `x @ w` with its caller, and kernel time is summed per line."""
import inspect
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from hlo_attribution import attribute, instruction_sources  # noqa: E402


def _matmul(x, w):
    return x @ w


def _loss(x, w):
    y = jnp.tanh(_matmul(x, w))
    return (y * y).sum()


def test_instructions_map_to_their_source_lines_and_kernel_time_sums_per_line():
    hlo = jax.jit(_loss).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
    sources = instruction_sources(hlo)
    dot_line = inspect.getsourcelines(_matmul)[1] + 1
    call_line = inspect.getsourcelines(_loss)[1] + 1
    dots = {name: src for name, src in sources.items() if name.startswith("dot")}
    assert dots, sorted(sources)[:20]
    src, context = next(iter(dots.values()))
    assert src == f"test_hlo_attribution.py:{dot_line} _matmul", src
    assert f"test_hlo_attribution.py:{call_line} _loss" in context and "dot_general" in context
    name = next(iter(dots))
    events = [{"name": "nvjet_gemm", "dur": 30.0, "args": {"hlo_op": name}},
              {"name": name.replace(".", "_"), "dur": 10.0, "args": {}},  # matched by its kernel name
              {"name": "memcpy", "dur": 5.0, "args": {"hlo_op": "command_buffer_1"}}]
    report = attribute(events, sources, steps=1)
    assert f"0.04  {2:5d}  test_hlo_attribution.py:{dot_line} _matmul" in report, report
    assert "unmatched kernels: memcpy 0.0 ms" in report
