"""Split the test modules into K groups of about equal measured time, one line of paths per group (scripts/test.sh
runs the whole suite as K pytest runs, each with fresh worker processes).

Why: a long-lived test worker compiles and frees thousands of XLA:CPU executables, and late in a whole-suite run
one of them sometimes died in libgcc's unwinder while jaxlib threw a C++ exception (a segfault in `_Unwind_Find_FDE`
under `PyLoadedExecutable.serialize`, 5 of 5 fresh-clone runs of 2026-12-06, always past ~85% of the run). LLVM JITs
register their code's unwind tables with libgcc, and a table left registered for freed code poisons every later
unwind in that process; fewer executables per process makes that rarer. Seconds per module come from
tests/module_seconds.txt (scripts/module_seconds.py); a module not listed there counts as DEFAULT_SECONDS.

    python scripts/test_chunks.py 3        # three lines of space-separated test files
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SECONDS = 5.0


def module_seconds() -> dict[str, float]:
    out = {}
    for line in (ROOT / "tests" / "module_seconds.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, module = line.split(maxsplit=1)
            out[module] = float(seconds)
    return out


def chunks(k: int) -> list[list[str]]:
    """The test modules in k groups: longest first, each to the group with the least time so far (LPT)."""
    seconds = module_seconds()
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    groups: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(k)]
    for m in sorted(modules, key=lambda m: -seconds.get(m, DEFAULT_SECONDS)):
        i = min(range(k), key=lambda j: groups[j][0])
        groups[i] = (groups[i][0] + seconds.get(m, DEFAULT_SECONDS), groups[i][1] + [m])
    return [g for _, g in groups if g]


if __name__ == "__main__":
    for group in chunks(int(sys.argv[1])):
        print(" ".join(group))
