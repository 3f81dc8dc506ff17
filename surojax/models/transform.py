"""`Transform`: the one interface through which a run changes a built model from outside the model code.

A transform is built from its typed spec (surojax/train/run_spec.py) and `build_run` applies the run's list in
this order (`TRANSFORM_ORDER`; each one sees the model the previous ones left):

    quantised base   QLoRA: the frozen base's Linear kernels quantised to a surojax.quant format (quant/)
    lora             adapters on the (quantised) base's targets; what trains is the adapters (peft/)
    fp8 | nvfp4      the Linear layers multiply in FP8 (current / delayed / blockwise scaling) or run the NVFP4
                     recipe (precision/)
    moe              expert capacity, router training, expert-parallel placement of MoE layers (parallel/expert.py)
    placement        where the weights live: the mesh's devices, host memory (offload_base, offload_master), streamed
                     per-layer host buffers (offload/placement.py); besides `apply` it has `build(make_model)`:
                     a model built straight into its shards or host buffers, with the transforms above applied
                     inside its construction (build_run)
    layer loop       the decoder's layer runner: recompute policy, unrolling, prefetching, pipeline (offload/,
                     parallel/pipeline.py)

Each transform says, besides `apply(model)`:
    trainable   an nnx filter of the state it makes trainable (None: it adds nothing); `freezes_base`: every
                nnx.Param outside the filters stays frozen (LoRA). The run trains the union of the filters, plus
                every nnx.Param unless a transform freezes the base
    hooks       `StepHooks` it adds to the training step, or None: step state carried through the step and
                checkpointed but not optimised, work before each step and micro-batch, work after the update
    memory      its settings of the memory plan (`surojax.offload.memory_plan.plan_memory` keyword arguments), the
                term the plan adds for it
    summary     the line it prints in the start-up summary (None: nothing to say)

Transforms never edit the model's source: they swap modules (`surojax.models.targets.replace_module`), set
variables, or set the decoder's layer runner. torchtitan's `ModelConverter` (convert + post-optimizer hook) is
the model this follows, with the step state that FP8 delayed scaling needs made part of the interface.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from flax import nnx

TRANSFORM_ORDER = ("quantized_base", "lora", "fp8", "nvfp4", "moe", "placement", "layer_loop")


@runtime_checkable
class StepState(Protocol):
    """State a transform carries in the trainable tree that the optimizer never sees (FP8 delayed scaling: the
    amax probes and histories). The step splits it off before the update and merges it back after it.

    Two parts: the observers, differentiated with the parameters (their gradient is what a micro-batch observed:
    FP8's amax probes), and the carried state (not differentiated: FP8's scales and histories), which `update`
    advances after the step from the observations of all micro-batches. A tree of zeros is `combine`'s identity
    (the step starts its accumulation there)."""

    def split(self, trainable) -> tuple[Any, Any, Any]:
        """trainable -> (what the optimizer updates, the observers, the carried state)."""

    def merge(self, params, observers, carried) -> Any:
        """The inverse of `split`."""

    def combine(self, acc, seen) -> Any:
        """Two micro-batches' observations (the observers' gradients) combined (amaxes: their max)."""

    def update(self, carried, seen) -> Any:
        """The carried state after a step that observed `seen` (rolled histories)."""


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """What a transform adds to the training step; every field optional.

    state         `StepState`: carried in the trainable tree, checkpointed with it, updated after the optimizer
                  (at most one transform of a run has one)
    before_step   f(model) -> value, once per step on the step's parameters (not differentiated): e.g. the FP8
                  weights quantised once per step
    before_micro  f(model, key, value) before each micro-batch's forward pass, on a fresh merged model; `key` is
                  distinct per step and micro-batch, `value` is `before_step`'s (None without one): dropout and
                  stochastic-rounding keys, the per-step FP8 weights attached
    compile       f(step, donate_argnums) -> the compiled step, in place of `jax.jit` (FP8 delayed scaling's first
                  and steady programs; at most one transform of a run has one)
    """
    state: StepState | None = None
    before_step: Callable[[nnx.Module], Any] | None = None
    before_micro: Callable[[nnx.Module, Any, Any], None] | None = None
    compile: Callable[[Callable, tuple[int, ...]], Callable] | None = None


@runtime_checkable
class Transform(Protocol):
    """A change applied to a built model from outside (module docstring)."""

    name: str  # one of TRANSFORM_ORDER: its place in the list and its key in the start-up summary
    freezes_base: bool  # the model's own nnx.Params stop training (LoRA); False for most

    def apply(self, model: nnx.Module) -> None:
        """Change `model` in place."""

    @property
    def trainable(self) -> nnx.filterlib.Filter | None:
        """The state this transform makes trainable, or None."""

    @property
    def hooks(self) -> StepHooks | None:
        """What it adds to the training step, or None."""

    @property
    def memory(self) -> Mapping[str, Any]:
        """Its settings of the memory plan (plan_memory keyword arguments)."""

    def summary(self) -> str | None:
        """Its start-up summary line, or None."""


def in_order(transforms: Sequence[Transform]) -> list[Transform]:
    """The transforms sorted by `TRANSFORM_ORDER`; a name outside it, or a name given twice, is refused."""
    seen: dict[str, Transform] = {}
    for t in transforms:
        if t.name not in TRANSFORM_ORDER:
            raise ValueError(f"transform {t.name!r} has no place in the order {', '.join(TRANSFORM_ORDER)}")
        if t.name in seen:
            raise ValueError(f"transform {t.name!r} is given twice")
        seen[t.name] = t
    return [seen[name] for name in TRANSFORM_ORDER if name in seen]


def apply_transforms(model: nnx.Module, transforms: Sequence[Transform]) -> list[Transform]:
    """Apply `transforms` to `model` in `TRANSFORM_ORDER`; -> the list as applied."""
    ordered = in_order(transforms)
    for t in ordered:
        t.apply(model)
    return ordered


def trainable_filter(transforms: Sequence[Transform]):
    """What the run trains: the union of the transforms' trainable filters, and every nnx.Param unless one of
    them freezes the base."""
    filters = [] if any(t.freezes_base for t in transforms) else [nnx.Param]
    filters += [t.trainable for t in transforms if t.trainable is not None]
    if not filters:
        raise ValueError("nothing trains: a transform freezes the base and none makes anything trainable")
    return filters[0] if len(filters) == 1 else nnx.Any(*filters)


def step_hooks(transforms: Sequence[Transform]) -> list[StepHooks]:
    """The transforms' step hooks, in order."""
    return [t.hooks for t in transforms if t.hooks is not None]


def memory_settings(transforms: Sequence[Transform]) -> dict[str, Any]:
    """The memory-plan settings of all transforms; one key set by two transforms is refused."""
    out: dict[str, Any] = {}
    for t in transforms:
        for key, value in t.memory.items():
            if key in out:
                raise ValueError(f"memory-plan setting {key!r} is set by two transforms")
            out[key] = value
    return out


def summary_lines(transforms: Sequence[Transform]) -> list[tuple[str, str]]:
    """(name, line) for each transform that has something to say, in order."""
    return [(t.name, line) for t in transforms if (line := t.summary()) is not None]
