"""`offload_base_weights`: the frozen base lives in host memory and crosses to the device one layer at a time.

    frozen state ──place_base_on_host──> layers.*  [L, ...] in `pinned_host` (bf16 arrays or quantised pytrees)
                                         embed / final_norm / lm_head stay on the device
    Decoder scan body, step l:   on_device(layer slice l)  = device_put(slice, Space.Device)   (decoder.py)

The decoder's scan slices every stacked weight per layer; a slice of a host-resident array is host-resident
too (its aval says `memory_space=Host`), and `models.decoder.on_device` copies exactly those leaves to the
device inside the scan body. The forward pass therefore fetches layer l when it runs it, and the backward
pass fetches it again where it recomputes the layer (`recompute: full | dots | offload`: the device copy is
never a saved residual, the host slice is). XLA's host-offload passes turn the copy into a host-to-device DMA
of the slice that its scheduler may start ahead of the compute that waits for it.
(It does not: the copies run serially with the compute, benchmarks/RESULTS.md#s3-streaming. `offload_prefetch: true` runs the
layers through prefetch.py instead, which issues the copy of layer l+1 explicitly during layer l.)

What moves: every frozen `nnx.Param` under `model.layers` and, on a hybrid (Qwen3.5), `model.linear_layers` (the
stacked kernels, quantised or not, the per-layer norm scales, the DeltaNet's conv / decay parameters; the layer
scan runs both stacks in layer order and fetches each layer's slice of its own stack), and an untied embedding table: the decoder fetches it whole for the token gather at the
start of the forward pass (the backward pass does not need it), so it occupies the device only then. What stays
on the device: the LoRA adapters (trained), the final norm, the LM head (used by the loss in the forward and the
backward pass) and a tied embedding (it is the LM head).

`recompute: none` is refused with streaming: without recomputation autodiff keeps each layer's device copy
of its weights for the backward pass, i.e. the whole base ends up on the device.

Host memory on the CPU backend: the CPU device exposes `device`, `pinned_host` and `unpinned_host` memory
spaces (all ordinary RAM); an array placed with memory kind `pinned_host` reports it, jit arguments carry it
(`f32<host>` in the jaxpr, layout `S(5)` in the HLO), and the in-jit `device_put` to the device is lowered
to a no-op. The CPU tests therefore check the placement and the program structure (a device_put of every
streamed leaf inside the scan body) plus exact numerical equality; the copies themselves only happen on GPU.
"""
from __future__ import annotations

import contextlib

import jax
from flax import nnx

from surojax.offload.host_layers import split_layers
from surojax.parallel import param_shardings

HOST_KIND = "pinned_host"
STREAMED_SUBTREE = "layers"  # the (first) layer stack: what the layerwise optimizer and offload_master split off
# every layer stack the base streams from (a hybrid has two: Qwen3.5's linear_layers, LFM2's conv_layers; lfm2_moe
# also its dense leading layers' dense_layers / dense_conv_layers)
STREAMED_STACKS = ("layers", "linear_layers", "conv_layers", "dense_layers", "dense_conv_layers")
EMBEDDING = ("embed", "embedding")


class OffloadError(ValueError):
    is_user_error = True


def host_memory_kind(device: jax.Device | None = None) -> str:
    """The host memory kind arrays are streamed from (`pinned_host`), or OffloadError naming what exists."""
    device = device or jax.devices()[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if HOST_KIND not in kinds:
        raise OffloadError(f"offload: the {device.platform} device {device} has no {HOST_KIND!r} memory (it has "
                           f"{', '.join(kinds)}); host offloading needs a backend with pinned host memory")
    return HOST_KIND


def _is_streamed(path: tuple, var) -> bool:
    return (bool(path) and path[0] in STREAMED_STACKS and isinstance(var, nnx.Param)
            and not isinstance(var, nnx.LoRAParam))


def _with_kind(x: jax.Array, kind: str) -> jax.Array:
    return jax.device_put(x, x.sharding.with_memory_kind(kind))


def _on_host(path: tuple, var, embedding: bool) -> bool:
    """What offload_base_weights puts in host memory: the streamed layers, and the embedding table when asked
    (an untied embedding is read once per forward pass, by the token gather: the decoder fetches it whole)."""
    return _is_streamed(path, var) or (embedding and tuple(path) == EMBEDDING and not isinstance(var, nnx.LoRAParam))


def place_base_on_host(frozen: nnx.State, *, kind: str | None = None, embedding: bool = False,
                       per_layer: bool = False) -> nnx.State:
    """`frozen` with every frozen Param under the layer stacks (`STREAMED_STACKS`; and the embedding table with `embedding`; only for an
    untied embedding: a tied one is the LM head too) moved to host memory, its sharding otherwise unchanged.
    per_layer (offload_prefetch): each stacked [L, ...] array becomes L host buffers (`HostLayers`), which the
    prefetching loop can copy asynchronously (host_layers.py says why).

    The input arrays are not modified; the caller drops its references to let the device copies go.
    """
    kind = kind or host_memory_kind()
    flat = []
    for path, var in nnx.to_flat_state(frozen):
        if _on_host(path, var, embedding):
            if per_layer and _is_streamed(path, var):
                var = var.replace(jax.tree.map(lambda x: split_layers(x, x.sharding.with_memory_kind(kind)),
                                               var.get_value()))
            else:
                var = var.replace(jax.tree.map(lambda x: _with_kind(x, kind), var.get_value()))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def streamed_leaves(state: nnx.State) -> dict[str, str]:
    """{dotted path: memory kind} of every array leaf of the layers' frozen Params (what streaming moves)."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        if not _is_streamed(path, var):
            continue
        for sub, x in jax.tree_util.tree_flatten_with_path(var.get_value())[0]:
            name = ".".join(map(str, path)) + "".join(str(k) for k in sub)
            out[name] = x.sharding.memory_kind
    return out


def check_streamed(state: nnx.State) -> int:
    """Raise OffloadError unless every stacked base weight is in host memory; return their bytes."""
    kinds = streamed_leaves(state)
    if not kinds:
        raise OffloadError("offload_base_weights: the model has no frozen per-layer weights to stream")
    resident = [k for k, v in kinds.items() if v != HOST_KIND]
    if resident:
        raise OffloadError(f"offload_base_weights: {len(resident)} base weights are not in host memory, e.g. "
                           f"{resident[0]} ({kinds[resident[0]]})")
    return host_bytes(state)


def host_bytes(state: nnx.State) -> int:
    """Bytes of the state's arrays that live in host memory."""
    return int(sum(x.nbytes for x in jax.tree.leaves(state)
                   if getattr(x, "sharding", None) is not None and x.sharding.memory_kind == HOST_KIND))


def place_model(model: nnx.Module, mesh, *, offload_base: bool, per_layer: bool = False) -> nnx.Module:
    """Place a built model on `mesh` by the parameter rules (as `parallel.shard_model`), the stacked base weights
    (and an untied embedding table) in host memory when `offload_base` (in place; returns the model); with
    `per_layer` (offload_prefetch) the stacked base as per-layer host buffers (`HostLayers`)."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh)
    if offload_base:
        kind = host_memory_kind(mesh.devices.flat[0])
        embedding = not model.cfg.tie_word_embeddings
        shardings = nnx.from_flat_state([
            (path, sh.replace(jax.tree.map(lambda s: s.with_memory_kind(kind), sh.get_value()))
             if _on_host(path, var, embedding) else sh)
            for (path, sh), (_, var) in zip(nnx.to_flat_state(shardings), nnx.to_flat_state(state))])
    if offload_base and per_layer:  # split the streamed stacks where they were built, layer by layer
        flat = []
        for (path, var), (_, sh) in zip(nnx.to_flat_state(state), nnx.to_flat_state(shardings)):
            if _is_streamed(path, var):
                var = var.replace(jax.tree.map(split_layers, var.get_value(), sh.get_value()))
            else:
                var = var.replace(jax.device_put(var.get_value(), sh.get_value()))
            flat.append((path, var))
        nnx.update(model, nnx.from_flat_state(flat))
        return model
    nnx.update(model, jax.device_put(state, shardings))
    return model


def build_context(offload_base: bool):
    """Where to build / load a model whose base will live in host memory: on the CPU backend when the default
    backend is an accelerator (so the base never sits whole in device memory), else where it is."""
    if not offload_base or jax.default_backend() == "cpu":
        return contextlib.nullcontext()
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return contextlib.nullcontext()
    return jax.default_device(cpu)
