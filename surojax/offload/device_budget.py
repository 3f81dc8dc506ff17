"""What a trainer keeps on the device beside the training step's memory plan, and the one check that the sum fits.

The memory plan (memory_plan.py) covers the compiled training step. A trainer may hold more on the device for
the whole run: GRPO's rollout KV pool (surojax/train/grpo.py), distillation's online teacher (its weights, and
the peak of its forward, surojax/train/distill.py). Each is a `Beside`:

    resident    bytes held from start-up to the end (the KV pool, the teacher's weights as placed)
    transient   the peak of a program that runs between training steps (the teacher's forward in next_batch):
                its buffers are freed before the step runs, so they overlap the plan's persistent part
                (weights, adapters, gradients, optimizer state) but not the step's own transients
                (activations, logits, workspace)

    peak = plan.total + sum(resident) + max(0, max(transient) - plan's transients)

All figures are bytes on ONE device, like the plan's.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import jax

from surojax.offload.memory_plan import GiB, MemoryPlan, MemoryPlanError

log = logging.getLogger(__name__)
STEP_TRANSIENTS = ("activations", "logits", "workspace")  # the plan's components freed after each step


@dataclasses.dataclass(frozen=True)
class Beside:
    """One thing on the device beside the training step (bytes per device)."""

    name: str  # what it is, as the log and the refusal say it: "teacher Qwen/Qwen3-8B", "rollout KV pool"
    resident: int
    transient: int = 0
    detail: str = ""  # how it was counted ("weights 15.3 GiB + forward 1.2 GiB for 8 x 4096 tokens")
    hint: str = ""  # what to change when the sum does not fit

    def describe(self) -> str:
        total = (self.resident + self.transient) / GiB
        return f"{self.name} {total:.2f} GiB" + (f" ({self.detail})" if self.detail else "")


def placed_bytes(tree, shardings) -> int:
    """Bytes ONE device holds of the arrays of `tree` once placed by `shardings` (a tree of the same structure,
    one Sharding per array leaf; a quantised weight's leaves are its packed arrays). Shapes only: works on
    abstract (jax.ShapeDtypeStruct) and host trees, before anything is on the device."""
    leaves, shard_leaves = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    if len(leaves) != len(shard_leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(shard_leaves)} shardings")
    return int(sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(leaves, shard_leaves)))


def plans_one_device(mesh) -> bool:
    """Whether the memory plan describes each device of `mesh`: no axis shards the parameters (fsdp, tensor,
    expert all 1). On other meshes the plan (one device holding the whole model) only bounds it from above, and
    build_run does not check it."""
    return mesh.shape["fsdp"] * mesh.shape["tensor"] * mesh.shape["expert"] == 1


def peak_with(plan: MemoryPlan | None, extras: Sequence[Beside]) -> int:
    """The run's peak device bytes: the step's plan (None: no training step, e.g. a teacher run alone) plus what
    stays beside it (the module docstring's formula)."""
    step_total = 0 if plan is None else plan.total
    step_transient = 0 if plan is None else sum(getattr(plan, k) for k in STEP_TRANSIENTS)
    between = max((b.transient for b in extras), default=0)
    return step_total + sum(b.resident for b in extras) + max(0, between - step_transient)


def check_beside(plan: MemoryPlan | None, extras: Sequence[Beside], capacity: int | None) -> int:
    """Log what stays beside the plan and return the peak; MemoryPlanError (naming each extra and its size)
    when `capacity` is known and the peak exceeds it."""
    peak = peak_with(plan, extras)
    step = "nothing else" if plan is None else f"the training plan's {plan.total / GiB:.2f} GiB"
    for b in extras:
        log.info("%s next to %s", b.describe(), step)
    if capacity is not None and peak > capacity:
        hints = "; ".join(b.hint for b in extras if b.hint)
        training = "" if plan is None else f"training ({plan.total / GiB:.1f} GiB) plus "
        raise MemoryPlanError(
            f"{training}{', '.join(b.describe() for b in extras)} needs an estimated {peak / GiB:.1f} GiB per "
            f"device, more than the device's {capacity / GiB:.1f} GiB" + (f"; {hints}" if hints else ""))
    return peak
