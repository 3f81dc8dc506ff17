"""MoE training and expert placement as a run's transform (surojax.models.transform).

    MoeTransform(capacity_factor=1.25, train_router=True, router_dtype=fp32, mesh=mesh)
      apply      every MoE layer's expert capacity (None: dropless); with train_router the router weights re-typed
                 as trainable (surojax.peft.trained_router: a LoRAParam subclass, so LoRA's filter picks them);
                 on a mesh with an `expert` axis > 1 the MoE layers run expert-parallel
                 (surojax.parallel.expert.apply_expert_parallel: each token to its experts' devices)
      trainable  None (the routers are LoRAParams: LoRA's filter already trains them; a full fine-tune trains
                 every weight anyway)

Lives in peft/ because it reaches both parallel/ (expert placement) and peft/ (the trained router).
"""
from __future__ import annotations

import logging

from flax import nnx

from surojax.models.targets import stacks
from surojax.parallel.expert import EXPERT_AXIS, apply_expert_parallel
from surojax.peft.trained_router import make_router_trainable

log = logging.getLogger(__name__)


class MoeTransform:
    name = "moe"
    freezes_base = False
    trainable = None
    hooks = None
    memory: dict = {}

    def __init__(self, *, capacity_factor: float | None, train_router: bool, router_dtype, mesh=None):
        self.capacity_factor, self.train_router, self.router_dtype = capacity_factor, train_router, router_dtype
        self.mesh = mesh  # None: no expert placement (a model built without a mesh: tests, abstract shapes)
        self.router_values: int | None = None

    def apply(self, model: nnx.Module) -> None:
        for stack in stacks(model).values():  # a hybrid's MoE layers are in both stacks
            stack.mlp.capacity_factor = self.capacity_factor
        if self.train_router:
            self.router_values = make_router_trainable(model, self.router_dtype)
            log.info("train_router: %s router values train with the adapter", f"{self.router_values:,}")
        if self.mesh is not None:
            apply_expert_parallel(model, self.mesh)

    def summary(self) -> str:
        ep = 1 if self.mesh is None else dict(self.mesh.shape).get(EXPERT_AXIS, 1)
        capacity = "dropless" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}"
        router = f", router trains ({self.router_values:,} values)" if self.router_values is not None else ""
        return f"experts {capacity}{router}, " + (f"expert-parallel over {ep} devices" if ep > 1 else "local")


__all__ = ["MoeTransform"]
