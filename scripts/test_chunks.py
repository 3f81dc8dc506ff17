"""Split the test modules into K groups of about equal measured time, one line of paths per group (scripts/test.sh
runs the whole suite as K pytest runs, each with fresh worker processes).

Why: a long-lived test worker compiles and frees thousands of XLA:CPU executables, and late in a whole-suite run
one of them sometimes died in libgcc's unwinder while jaxlib threw a C++ exception (a segfault in `_Unwind_Find_FDE`
under `PyLoadedExecutable.serialize`, 5 of 5 fresh-clone runs of 2026-12-06, always past ~85% of the run). LLVM JITs
register their code's unwind tables with libgcc, and a table left registered for freed code poisons every later
unwind in that process; fewer executables per process makes that rarer. Seconds per module come from
tests/module_seconds.txt (scripts/module_seconds.py); a module not listed there counts as DEFAULT_SECONDS.

The modules whose checks run in one shared virtual-device child (tests/parallel/virtual_devices.py SHARED) stay in
one group: each pytest run starts that child once, so split over three groups it ran three times (its 70-166 s
each in the run of 2026-12-07).

    python scripts/test_chunks.py 3        # three lines of space-separated test files
"""
from __future__ import annotations

import ast
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


def shared_child_modules() -> list[list[str]]:
    """Test files whose checks share one child, per device count (read from virtual_devices.py's SHARED without
    importing it: this script runs before pytest)."""
    tree = ast.parse((ROOT / "tests" / "parallel" / "virtual_devices.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHARED" for t in node.targets):
            return [[name.replace(".", "/") + ".py" for name in mods] for mods in ast.literal_eval(node.value).values()]
    raise SystemExit("tests/parallel/virtual_devices.py: no SHARED table")


def chunks(k: int) -> list[list[str]]:
    """The test modules in k groups: longest unit first, each to the group with the least time so far (LPT); a unit
    is one module, or the modules of one shared child together."""
    seconds = module_seconds()
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    units = [[m for m in group if m in modules] for group in shared_child_modules()]
    together = {m for unit in units for m in unit}
    units = [u for u in units if u] + [[m] for m in modules if m not in together]
    costs = [sum(seconds.get(m, DEFAULT_SECONDS) for m in unit) for unit in units]
    groups: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(k)]
    for cost, unit in sorted(zip(costs, units), key=lambda cu: -cu[0]):
        i = min(range(k), key=lambda j: groups[j][0])
        groups[i] = (groups[i][0] + cost, groups[i][1] + unit)
    return [g for _, g in groups if g]


if __name__ == "__main__":
    for group in chunks(int(sys.argv[1])):
        print(" ".join(group))
