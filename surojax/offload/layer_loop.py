"""The layer-loop transform (`Transform` "layer_loop", surojax/models/transform.py): it sets the decoder's layer
runner (surojax/models/layer_runner.py) from the run's resolved memory settings.

    recompute, unroll     -> LayerScan(recompute, unroll): the plain scan, each layer under the recompute policy
    offload_prefetch      -> PrefetchedLayers (prefetch.py): the streamed base fetched one layer ahead (recompute
                             full semantics), as the unrolled per-layer loop
    parallel.stage > 1    -> PipelinedLayers (parallel/pipeline.py): the stages' microbatch schedule, each layer
                             under the recompute policy

`recompute` and `unroll` arrive resolved (`recompute: auto` / `unroll_layers: auto`: layer_loop_choice.py picks
them from the memory plan); `memory` hands them to the plan, `summary()` is the start-up summary's `layers` line.

Evaluation (the eval graphdef: the eval step, evaluation generation, GRPO's reference log-probs) runs
`eval_runner`: the plain rolled scan without recompute (nothing is differentiated; an unrolled loop would compile
every layer for each of those programs), or the prefetching / pipelined runner itself (a base held as per-layer
host buffers is read by that runner only; a pipelined model's layers live on their stages).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flax import nnx

from surojax.models.layer_runner import LayerRunner, LayerScan, Recompute
from surojax.offload.prefetch import PrefetchedLayers
from surojax.parallel.pipeline import PipelinedLayers


@dataclasses.dataclass(frozen=True)
class LayerLoop:
    """The layer-loop transform. reason: why this recompute / unroll (layer_loop_choice), printed with the
    pipeline's shape in the summary line."""

    recompute: Recompute
    unroll: int | bool = 1
    prefetch: bool = False
    pipeline: PipelinedLayers | None = None
    reason: str = ""

    name: ClassVar[str] = "layer_loop"
    freezes_base: ClassVar[bool] = False

    def __post_init__(self):
        if self.prefetch and self.recompute is not Recompute.FULL:
            raise ValueError(f"offload_prefetch recomputes each layer whole: recompute must be full, not "
                             f"{self.recompute.value}")
        if self.prefetch and self.pipeline is not None:
            raise ValueError("offload_prefetch and pipeline stages are two layer runners: use one")

    @property
    def runner(self) -> LayerRunner:
        """The runner the training step's forward and backward passes use."""
        if self.pipeline is not None:
            return self.pipeline
        if self.prefetch:
            return PrefetchedLayers(per_layer=True, unroll=self.unroll)
        return LayerScan(self.recompute, self.unroll)

    @property
    def eval_runner(self) -> LayerRunner:
        """The runner of the evaluation forward pass (module docstring)."""
        if self.pipeline is not None or self.prefetch:
            return self.runner
        return LayerScan()

    def apply(self, model: nnx.Module) -> None:
        model.runner = self.runner

    @property
    def trainable(self) -> None:
        return None

    @property
    def hooks(self) -> None:
        return None

    @property
    def memory(self) -> dict[str, Any]:
        return {"recompute": self.recompute, "unroll": self.unroll}

    def summary(self) -> str:
        return self.reason + ("" if self.pipeline is None else "; " + self.pipeline.describe())


__all__ = ["LayerLoop"]
