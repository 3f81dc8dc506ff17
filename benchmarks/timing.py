"""`timeit`: the benchmarks' one timing rule for a jitted call (imported as a sibling: benchmarks/ is sys.path[0])."""
from __future__ import annotations

import statistics
import time

import jax


def timeit(f, *args, iters: int, repeats: int = 3) -> float:
    """Seconds per call: compile + 2 warm-up calls, then the median over `repeats` of `iters` calls."""
    for _ in range(3):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)
