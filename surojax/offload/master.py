"""`offload_master`: place a full fine-tuning model so that its layers' fp32 master weights never sit whole on the
device.

    build the model on the CPU backend (streaming.build_context)
    place_master_on_host: the trainable Params under `layers` ([L, ...], fp32) -> pinned host memory, the rest
                          (embedding, head, final norm) -> the device, by the parameter rules
    init_opt_state:       the layerwise optimizer's `master` takes those host arrays as they are
    optimizer.compute_copy: each layer leaf is fetched to the device and cast to bf16 there, one leaf at a time

so the device holds at most one fp32 [L, ...] leaf at a time during set-up (the largest of an 8B: 7.2 GB).
"""
from __future__ import annotations

import jax
from flax import nnx

from surojax.offload.streaming import STREAMED_SUBTREE, host_memory_kind
from surojax.parallel import param_shardings


def place_master_on_host(model: nnx.Module, mesh) -> nnx.Module:
    """Place a built model on `mesh` by the parameter rules (as `parallel.shard_model`), its Params under
    `layers` in pinned host memory (in place; returns the model)."""
    state = nnx.state(model)
    kind = host_memory_kind(mesh.devices.flat[0])
    shardings = param_shardings(state, mesh)
    shardings = nnx.from_flat_state([
        (path, sh.replace(jax.tree.map(lambda s: s.with_memory_kind(kind), sh.get_value()))
         if path[0] == STREAMED_SUBTREE and isinstance(var, nnx.Param) else sh)
        for (path, sh), (_, var) in zip(nnx.to_flat_state(shardings), nnx.to_flat_state(state))])
    nnx.update(model, jax.device_put(state, shardings))
    return model
