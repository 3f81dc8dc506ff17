"""Time intervals of a jax.profiler trace (shared by the profiling scripts): merge kernels' [start, end) intervals
and measure how much of one interval they cover (e.g. copy time under compute kernels)."""
from __future__ import annotations

import bisect


def union(intervals):
    """Merge [start, end) intervals; returns the sorted disjoint list [[start, end], ...]."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(s, e, merged) -> float:
    """How much of [s, e) the disjoint sorted intervals `merged` (from `union`) cover."""
    i = max(bisect.bisect_right([m[0] for m in merged], s) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < e:
        total += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
        i += 1
    return total
