"""Placement as a run's transform (surojax.models.transform): where the weights live — the mesh's devices by the
parameter rules, host memory for a streamed frozen base (`offload_base`, as per-layer host buffers with
`offload_prefetch`) or the fp32 master weights (`offload_master`).

Placement interleaves with construction, so besides `apply(model)` (place a model built whole: a loaded
checkpoint) it has `build(make_model)`, which `build_run` calls with the model's construction and the transforms
before it (`make_model(shardings_of)`):

    init jit    `init_sharded`: every array computed in its shard on the devices (a host-bound base: host_init)
    init host   `random_placed_model`: random values made on the host and placed leaf by leaf
    init build  loaded (a device-bound, unquantised HF base straight into its shards, each process reading its
                part; a host-bound one off the device: `build_context`), then `apply`

Its memory-plan settings: offload_base, prefetch, offload_master (offload/memory_plan.py). The thin wrapper over
streaming.py / master.py / host_init.py the build used before the transform list; nothing new is decided here.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from flax import nnx

from surojax.offload.host_init import random_placed_model
from surojax.offload.master import place_master_on_host
from surojax.offload.streaming import build_context, place_model
from surojax.parallel import init_sharded, param_shardings


class Placement:
    name = "placement"
    freezes_base = False
    trainable = None
    hooks = None

    def __init__(self, mesh, *, init: str = "build", offload_base: bool = False, prefetch: bool = False,
                 offload_master: bool = False, seed: int = 0, load_sharded: bool = True):
        """init: the ModelSpec's (build | jit | host); load_sharded: a loaded base may be read straight into its
        shards (False for a base the earlier transforms quantise)."""
        self.mesh, self.init, self.seed = mesh, init, seed
        self.offload_base, self.prefetch, self.offload_master = offload_base, prefetch, offload_master
        self.load_sharded = load_sharded

    @property
    def per_layer(self) -> bool:
        return self.offload_base and self.prefetch

    def apply(self, model: nnx.Module) -> None:
        """Place a built model (in place)."""
        if self.offload_master:
            place_master_on_host(model, self.mesh)
        else:
            place_model(model, self.mesh, offload_base=self.offload_base, per_layer=self.per_layer)

    def build(self, make_model: Callable[..., nnx.Module]) -> nnx.Module:
        """The model `make_model(shardings_of=None)` builds, made where it lives (module docstring)."""
        if self.init == "host" or (self.init == "jit" and self.offload_base):
            model = random_placed_model(make_model, self.mesh, offload_base=self.offload_base, seed=self.seed,
                                        per_layer=self.per_layer)
        elif self.init == "jit":
            model = init_sharded(make_model, self.mesh)
        else:
            direct = not (self.offload_base or self.offload_master) and self.load_sharded
            with build_context(self.offload_base or self.offload_master):  # a host-bound base: off the device
                model = make_model(functools.partial(param_shardings, mesh=self.mesh) if direct else None)
            self.apply(model)
            return model
        if self.offload_master:
            place_master_on_host(model, self.mesh)
        return model

    @property
    def memory(self) -> dict:
        return {"offload_base": self.offload_base, "prefetch": self.prefetch, "offload_master": self.offload_master}

    def summary(self) -> str | None:
        where = [w for w, on in (("the frozen base in host memory, streamed per layer" +
                                  (" (prefetched)" if self.prefetch else ""), self.offload_base),
                                 ("the fp32 master weights in host memory", self.offload_master)) if on]
        return "; ".join(where) or None


__all__ = ["Placement"]
