"""ZeRO stages over the data-parallel devices: where the parameters, the gradients and the optimizer state live.

    stage  parameters        accumulated gradients             optimizer state / the update computed on it
    0      the rules         like the parameters (all-reduced) like the parameters
    1      the rules         like the parameters (all-reduced) split over `data`: each device updates its shard,
                                                               the new parameters are all-gathered to the rules'
    2      the rules         split over `data` (each micro-batch's gradients reduce-scattered into the accumulator)
                                                               split over `data`, as 1
    3      the rules on a mesh whose fsdp axis holds the N data devices (= `parallel: {fsdp: N}`: `embed` splits
           over fsdp); gradients and optimizer state follow the parameters. No code of its own here.

"Split over data" (`zero_rules`): the dimension the rules map `embed` to also splits over `data`; an array without
`embed`, or whose `embed` dimension `data` does not divide, splits its largest dimension that `data` divides
(`spread`); an array nothing divides (a tiny bias) stays as the parameter. The 8-bit AdamW state (blocks
[n_blocks, 256] and absmax [n_blocks], no parameter layout) splits its blocks (dimension 0) over `block_axes`: data at stages 1-2, fsdp at stage 3.

Stages 1 and 2 differ in the gradients only: at stage 1 the fp32 accumulator is whole on every device and the
update slices it; at stage 2 each device accumulates 1/N of it. Stages 0 and 3 leave placement to the parameters'
shardings (GSPMD propagation: the step compiles as it always did); 1 and 2 constrain the step's trees to the
shardings of `ZeroLayout` (surojax/train/step.py `StepShardings`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from surojax.parallel.rules import PARAM_RULES, Rules, param_shardings, zero_rules

DATA = "data"


class ZeroStageError(ValueError):
    """A ZeRO stage that contradicts the mesh or the other settings."""

    is_user_error = True


def resolve_zero_stage(stage: int | None, mesh) -> int:
    """The stage a run on `mesh` trains with: `stage`, or (None) the mesh's own (3 when fsdp > 1, else 0).
    Raises ZeroStageError where the two disagree."""
    fsdp, data = mesh.shape["fsdp"], mesh.shape[DATA]
    if stage is None:
        return 3 if fsdp > 1 else 0
    if stage not in (0, 1, 2, 3):
        raise ZeroStageError(f"zero_stage {stage!r}: expected 0, 1, 2 or 3")
    if stage < 3 and fsdp > 1:
        raise ZeroStageError(f"zero_stage {stage} keeps the parameters whole on every data device, but the mesh "
                             f"has parallel.fsdp = {fsdp}, which shards them (ZeRO-3): set zero_stage 3 or fsdp 1")
    if stage == 3 and fsdp == 1 and data > 1:
        raise ZeroStageError(f"zero_stage 3 over data = {data} is the mesh parallel: {{fsdp: {data}}}; make the "
                             "mesh from TrainConfig.mesh_sizes() (it spells the stage so)")
    return stage


def block_axes(stage: int, mesh) -> tuple[str, ...]:
    """The mesh axes that split the 8-bit AdamW state's blocks at `stage` (sizes 1 left out)."""
    axes = {0: (), 1: (DATA,), 2: (DATA,), 3: ("fsdp",)}[stage]
    return tuple(a for a in axes if mesh.shape[a] > 1)


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spread(sharding: NamedSharding, shape: tuple[int, ...], axes: tuple[str, ...],
           dims: tuple[int, ...] | None = None) -> NamedSharding:
    """`sharding` with each mesh axis of `axes` it does not use yet added to the largest dimension of `shape` (of
    `dims`, default all) that it divides (after the dimension's own split; ties: the first); unchanged where no
    such dimension is divisible."""
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for axis in axes:
        n = mesh.shape[axis]
        if n == 1 or any(axis in _axes_of(e) for e in spec):
            continue
        split = [math.prod(mesh.shape[a] for a in _axes_of(e)) for e in spec]
        fits = [i for i in (range(len(shape)) if dims is None else dims) if shape[i] % (split[i] * n) == 0]
        if not fits:
            continue
        i = max(fits, key=lambda d: (shape[d] // split[d], -d))
        spec[i] = axis if spec[i] is None else (*_axes_of(spec[i]), axis)
    return NamedSharding(mesh, P(*spec))


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """Sharding trees (shaped like the trainable params, one NamedSharding per array) of one ZeRO stage.

    params       where the parameters live before and after the step
    gradients    the fp32 accumulated gradients (stage 2: split over data, so reduce-scattered into)
    state        what the optimizer's parameter-shaped state (AdamW mu / nu) follows; the update of stages 1-2
                 reads gradients and parameters re-sliced to it
    block_axes   mesh axes splitting the 8-bit AdamW blocks
    """
    stage: int
    params: Any
    gradients: Any
    state: Any
    block_axes: tuple[str, ...]

    @property
    def constrains_step(self) -> bool:
        """Whether the step must be told the shardings (stages 1-2; 0 and 3 follow the parameters)."""
        return self.stage in (1, 2)


def split_over_data(state, mesh, rules: Rules = PARAM_RULES):
    """Shardings of `state` (an nnx.State with logical `axes`) under `zero_rules`, spread over `data` where the
    rules could not place it. Same tree as `param_shardings`."""
    by_rules = param_shardings(state, mesh, zero_rules(rules, DATA))
    return jax.tree.map(lambda x, s: spread(s, tuple(x.shape), (DATA,)), state, by_rules)


def zero_layout(stage: int, trainable, mesh, rules: Rules = PARAM_RULES) -> ZeroLayout:
    """The layout of `trainable` (placed params, an nnx.State) at `stage` (resolved: resolve_zero_stage)."""
    params = jax.tree.map(lambda x: x.sharding, trainable)
    split = split_over_data(trainable, mesh, rules) if stage in (1, 2) else params
    return ZeroLayout(stage=stage, params=params, gradients=split if stage == 2 else params, state=split,
                      block_axes=block_axes(stage, mesh))


def plan_divisors(stage: int, mesh) -> dict[str, int]:
    """What the stage divides the one-device memory plan's components by (surojax/offload/memory_plan.py):
    weight_shards (params and their gradients, stage 3), gradient_shards (the fp32 accumulator, stages 2-3),
    optimizer_shards (stages 1-3)."""
    n = mesh.shape["fsdp"] if stage == 3 else mesh.shape[DATA] if stage in (1, 2) else 1
    return {"weight_shards": n if stage == 3 else 1, "gradient_shards": n if stage >= 2 else 1,
            "optimizer_shards": n if stage >= 1 else 1}


__all__ = ["ZeroStageError", "ZeroLayout", "resolve_zero_stage", "block_axes", "spread", "split_over_data",
           "zero_layout", "plan_divisors"]
