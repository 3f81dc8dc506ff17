"""Suite-wide: the slowest test modules run first (tests/module_seconds.txt, written by scripts/module_seconds.py),
and the garbage collector is tuned for tracing (pytest_configure).

scripts/test.sh runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`: xdist hands whole modules to the two
workers in collection order, so ordering the slowest first lets the short ones fill in at the end (longest
processing time first) instead of one worker running a long module alone while the other idles. Only the order
changes; a module missing from the list keeps its place after the listed ones.
"""
from __future__ import annotations

import gc
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("module_seconds.txt")


def _module_seconds() -> dict[str, float]:
    if not SECONDS_FILE.exists():
        return {}
    out = {}
    for line in SECONDS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, module = line.split(maxsplit=1)
            out[module] = float(seconds)
    return out


def pytest_configure(config):
    """Python's cyclic garbage collector, tuned for tracing: JAX's tracing and lowering allocate millions of short-lived
    objects, and with the default thresholds (700, 10, 10) the collector keeps re-walking every module the suite has
    imported. Frozen after start-up (those objects leave the collected generations) and collected less often, the
    tests spend less CPU: on test_step_equivalences + test_grpo_loss 1-6% with the machine otherwise idle, ~10%
    with it loaded (47.9 -> 42.9 s). The gain is the higher threshold; freezing alone measured nothing. Only when
    the collector runs changes; what it frees does not.

    Also: the persistent compilation cache the workers share (scripts/test.sh) writes its entries atomically
    (surojax.compilation_cache.atomic_cache_writes: a worker reading an entry the other was still writing
    crashed)."""
    from surojax.compilation_cache import atomic_cache_writes

    atomic_cache_writes()
    if not hasattr(config, "workerinput"):  # the xdist controller (or a plain run)
        _no_hang_after_a_worker_crash()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def pytest_collection_modifyitems(config, items):
    seconds = _module_seconds()
    if seconds:  # stable: tests keep their order within a module
        items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))


def _no_hang_after_a_worker_crash() -> None:
    """pytest-xdist 3.8.0's module scheduler (--dist loadfile) hangs after a worker crashes, with both workers idle
    until CI's time runs out (fresh-clone runs of 2026-12-06: a worker killed by a segfault, then 60+ idle minutes).
    Two causes, both fixed upstream after 3.8.0 (pytest-xdist issues #1323 / #1327 / #1378, PRs #1324 / #1328 /
    #1363): `remove_node` puts the dead worker's whole workload back on the queue, its finished modules included,
    and each of those becomes an empty unit that never reports completion, so the worker given it is never
    rescheduled; and a worker given a unit of one pending test waits for a next test (or shutdown) that never comes.
    Also, the crashed test goes back on the queue and takes each replacement worker down in turn (PR #1371).
    Patched here, on the controller only: finished units and the crashed test are not re-queued (the rest of its
    module is), and rescheduling tops a worker up until it holds more than two pending tests or the queue is empty
    (then shuts it down, as 3.8.0 does when the queue is empty). The crashed test still fails the run: xdist
    reports it. A later xdist, which has the fixes, is left alone."""
    try:
        from xdist.scheduler.loadscope import LoadScopeScheduling
        import xdist
    except ImportError:
        return
    if xdist.__version__ != "3.8.0" or getattr(LoadScopeScheduling, "_surojax_patched", False):
        return
    def remove_node_keeping_unfinished(self, node):  # 3.8.0's remove_node, less the finished work
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        crashed = next(nodeid for nodeid, done in next(iter(unfinished.values())).items() if not done)
        unfinished[next(iter(unfinished))][crashed] = True  # reported as failed by xdist; not run again
        self.workqueue.update({scope: unit for scope, unit in unfinished.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def reschedule_until_enough(self, node):
        if node.shutting_down:
            return
        while self.workqueue and self._pending_of(self.assigned_work.get(node, {})) <= 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()

    LoadScopeScheduling.remove_node = remove_node_keeping_unfinished
    LoadScopeScheduling._reschedule = reschedule_until_enough
    LoadScopeScheduling._surojax_patched = True
