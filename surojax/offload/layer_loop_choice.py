"""`recompute: auto` / `unroll_layers: auto`: the fastest layer loop whose planned peak fits the device.

`choose_layer_loop(plan_fn, capacity, recompute=, unroll=, offload_base=, prefetch=)` (recompute: a `Recompute`,
None for auto) walks the candidates
fastest first and returns the first whose plan (`plan_fn(recompute, unroll) -> MemoryPlan`) fits
`USABLE_FRACTION` of the capacity, with a one-line reason for the start-up summary.

Candidates, fastest first (the order and the reasons come from the benchmarks in benchmarks/RESULTS.md):

    (none, unrolled)   the fastest loop (Qwen3-0.6B LoRA and full fine-tune, Qwen3-8B LoRA), and it peaks LOWER
                       than (none, rolled): the inlined layers keep their residuals as separate buffers instead of
                       [L, ...] stacks written by dynamic_update_slice (memory_plan.py models the drop). Its price
                       is compile time (one program per layer; see `compilation_cache.py`)
    (full, rolled)     the recompute costs next to nothing inside the scan (the scan's stack copies, not the
                       recomputed forward, bound that step), at a fraction of the memory; the trainer's old default
    (offload, rolled)  full with each layer's input in host memory (device activations O(1) in depth)

Left out, each dominated by a candidate above:
    (none, rolled)     slower than (none, unrolled) and planned bigger: it never fits where that does not
    (dots, rolled)     slower than (none, rolled) (it recomputes the attention), more memory than full
    (dots, unrolled)   not benchmarked; the plan keeps nearly what (none, unrolled) keeps, so the band where it
                       would be chosen is a few percent of the capacity
    (full, unrolled)   benchmarked only as offload_prefetch's per-layer twin: no faster than the rolled scan, at a
                       larger peak

Constraints. `offload_base_weights` (the base streamed from host memory) forbids none: its candidates are
(full, rolled), (offload, rolled): the streamed step is bound by the host link, so the smallest footprint wins,
and an unrolled loop over a stacked host base slices it serially (no faster, unbounded look-ahead).
`offload_prefetch` needs full and runs its own per-layer loop (prefetch.py), whatever `unroll`: (full, rolled).
A value the user set (not `auto`) is kept: it only filters the candidates (and is checked against the
constraints); a pair set in full is returned as it is, fitting or not (`check_fits` reports it with options).

No capacity (CPU, or a backend without memory statistics): (none, rolled): no recomputed forward, one compiled
layer body (an unrolled program compiles every layer; the CPU quickstart stays quick to start).

When nothing fits, the smallest candidate is returned with a reason saying so; `memory_plan.check_fits` then
raises with the options that would fit.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

from surojax.models.layer_runner import Recompute
from surojax.offload.memory_plan import GiB, MemoryPlan

AUTO = "auto"  # unroll_layers: auto (recompute's auto is None)
UNROLLED: bool = True  # every layer inlined
ROLLED: int = 1  # the scan, one layer per iteration
# headroom for the plan's error against the measured peaks it is calibrated on (tests/offload/test_memory_plan.py
# holds them and the error bound): an underestimate within that bound does not run out of memory
USABLE_FRACTION = 0.90
NONE, FULL, OFFLOAD = Recompute.NONE, Recompute.FULL, Recompute.OFFLOAD
FASTEST_FIRST: tuple[tuple[Recompute, int | bool], ...] = ((NONE, UNROLLED), (FULL, ROLLED), (OFFLOAD, ROLLED))
STREAMED: tuple[tuple[Recompute, int | bool], ...] = ((FULL, ROLLED), (OFFLOAD, ROLLED))
NO_CAPACITY: tuple[Recompute, int | bool] = (NONE, ROLLED)

PlanFn = Callable[[Recompute, "int | bool"], MemoryPlan]


@dataclasses.dataclass(frozen=True)
class LayerLoopChoice:
    """The layer loop a run uses: `recompute` (a `Recompute`), `unroll` (True: every layer inlined;
    an int: layers per scan iteration), the `plan` of that pair, and `reason`, one line for the start-up summary."""

    recompute: Recompute
    unroll: int | bool
    plan: MemoryPlan
    reason: str


def describe_unroll(unroll: int | bool) -> str:
    if unroll is True:
        return "layers unrolled"
    return "layers rolled" if unroll == 1 else f"{unroll} layers per scan step"


def _check_constraints(recompute: Recompute, *, offload_base: bool, prefetch: bool) -> None:
    if offload_base and recompute is NONE:
        raise ValueError("offload_base_weights fetches each layer again in the backward pass: recompute none is "
                         "not possible (use full, dots or offload)")
    if prefetch and recompute is not FULL:
        raise ValueError(f"offload_prefetch recomputes each layer whole: recompute must be full, not "
                         f"{recompute.value}")


def _candidates(recompute: Recompute | None, unroll: int | bool | Literal["auto"], *, capacity: int | None,
                offload_base: bool, prefetch: bool) -> list[tuple[Recompute, int | bool]]:
    """The pairs to try in order, the user's set values kept."""
    if prefetch:
        order = [(FULL, ROLLED)]
    elif offload_base:
        order = list(STREAMED)
    elif capacity is None:
        order = [NO_CAPACITY]
    else:
        order = list(FASTEST_FIRST)
    if recompute is not None:
        _check_constraints(recompute, offload_base=offload_base, prefetch=prefetch)
        # the order's unroll for this recompute where it has one, else rolled (no unrolled gain measured)
        unrolls = [u for r, u in order if r == recompute] or [ROLLED]
        order = [(recompute, u) for u in unrolls]
    if unroll != AUTO:
        order = list(dict.fromkeys((r, unroll) for r, _ in order))
    return order


def choose_layer_loop(plan_fn: PlanFn, capacity: int | None, *, recompute: Recompute | None = None,
                      unroll: int | bool | Literal["auto"] = AUTO, offload_base: bool = False,
                      prefetch: bool = False) -> LayerLoopChoice:
    """The first candidate (module docstring) whose planned peak is <= USABLE_FRACTION * capacity.

    plan_fn(recompute, unroll) -> MemoryPlan of the run with that layer loop (everything else fixed).
    capacity: the device's allocator limit in bytes (`memory_plan.device_capacity()`), None where unknown.
    recompute / unroll: the run's values; None / "auto" lets this choose, anything else is kept.
    offload_base / prefetch: `offload_base_weights` / `offload_prefetch` (constrain the candidates).
    """
    order = _candidates(recompute, unroll, capacity=capacity, offload_base=offload_base, prefetch=prefetch)
    chosen_by = "auto" if recompute is None or unroll == AUTO else "set in the config"
    if capacity is None:
        r, u = order[0]
        return LayerLoopChoice(r, u, plan_fn(r, u), f"recompute {r.value}, {describe_unroll(u)} "
                                                    f"(no device capacity known; {chosen_by})")
    usable = int(USABLE_FRACTION * capacity)
    plans = []
    for r, u in order:
        plan = plan_fn(r, u)
        plans.append((r, u, plan))
        if plan.total <= usable:
            return LayerLoopChoice(r, u, plan, f"recompute {r.value}, {describe_unroll(u)}: planned "
                                               f"{plan.total / GiB:.1f} of {usable / GiB:.1f} GiB usable fits "
                                               f"({chosen_by})")
    r, u, plan = min(plans, key=lambda p: p[2].total)
    return LayerLoopChoice(r, u, plan, f"recompute {r.value}, {describe_unroll(u)}: planned "
                                       f"{plan.total / GiB:.1f} GiB, "
                                       f"more than the {usable / GiB:.1f} GiB usable ({chosen_by}; "
                                       f"nothing smaller among the candidates)")
