"""Sleep mode (vLLM's level 1): an idle engine's weights move to host memory and its KV pool is freed; waking
puts the weights back where they were and makes a fresh, empty pool.

    slept = put_to_sleep(engine.runners, model=engine.model)   # device buffers deleted, host copies kept
    wake_up(slept, engine.runners, model=engine.model)         # same values, same shardings, zeroed pools

Each runner (the target's, a speculative draft's) holds its weights as ``runner.state`` (the model's nnx state:
the same arrays as the model's Variables) and its pools as ``k_pool`` / ``v_pool`` (+ ``state_pool``, a hybrid
model's linear-attention states). Sleeping copies every weight array to the host (the device's ``pinned_host``
memory where it has one, as JAX places host-offloaded arrays; otherwise a numpy copy), waits for the copies,
then deletes the device buffers: the weights and the pools are gone from the device, not merely unreferenced.
An array shared by two Variables (tied embeddings) is copied once and comes back shared. Waking puts each copy
back with the sharding it had and re-creates the pools (zeros; the caller drops the prefix cache, whose blocks
they held). The values are the same bits, so greedy output after a wake equals the output before sleeping.

The caller guarantees that nothing runs meanwhile (`Engine.sleep` refuses an engine with requests in flight,
and runs on the engine's own thread in the server). Level 2 (vLLM: discard the weights, reload them later) is
not offered: a level-1 sleep already frees the device, and reloading would read the checkpoint again.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HOST_MEMORY_KIND = "pinned_host"


@dataclasses.dataclass
class Slept:
    """What a sleeping engine keeps: per runner, its weight tree with host copies in place of the device arrays
    (leaf -> (host copy, original sharding)), and the shape / dtype of each pool to re-create."""

    weights: list[Any]
    pools: list[dict[str, Any]]

    @property
    def host_bytes(self) -> int:
        return sum(h.nbytes for tree in self.weights for h, _ in jax.tree.leaves(tree, is_leaf=_is_entry)
                   if isinstance(h, (jax.Array, np.ndarray)))


def _is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], jax.sharding.Sharding)


def _host_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    """`sharding` in the devices' pinned host memory, or None where a device has none."""
    for device in sharding.device_set:
        if HOST_MEMORY_KIND not in {m.kind for m in device.addressable_memories()}:
            return None
    return sharding.with_memory_kind(HOST_MEMORY_KIND)


def _to_host(x: jax.Array):
    host = _host_sharding(x.sharding)
    return jax.device_put(x, host) if host is not None else np.array(x)


def _pool_fields(runner) -> dict[str, Any]:
    return {name: getattr(runner, name) for name in ("k_pool", "v_pool", "state_pool")
            if getattr(runner, name, None) is not None}


def put_to_sleep(runners, model=None) -> Slept:
    """Copy each runner's weights to the host, then delete their device buffers and the runners' pools.
    model: the nnx module whose Variables hold the first runner's arrays (they are deleted with them)."""
    copies: dict[int, tuple[Any, jax.sharding.Sharding]] = {}  # id(device array) -> (host copy, its sharding)

    def offload(x):
        if not isinstance(x, jax.Array):
            return x
        if id(x) not in copies:
            copies[id(x)] = (_to_host(x), x.sharding)
        return copies[id(x)]

    weights = [jax.tree.map(offload, r.state) for r in runners]
    pools = [{name: jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding), pool)
              for name, pool in _pool_fields(r).items()} for r in runners]
    jax.block_until_ready([h for h, _ in copies.values() if isinstance(h, jax.Array)])
    for r in runners:
        doomed = jax.tree.leaves(r.state) + jax.tree.leaves(list(_pool_fields(r).values()))
        for x in doomed:
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        r.state = None
        for name in _pool_fields(r):
            setattr(r, name, None)
    del model  # its Variables hold the deleted arrays until wake_up puts the live ones back
    return Slept(weights, pools)


def wake_up(slept: Slept, runners, model=None) -> None:
    """Put the weights back on their devices (same sharding) and give each runner fresh, zeroed pools.
    model: the nnx module of the first runner, updated to hold the live arrays again."""
    back: dict[int, jax.Array] = {}  # id(host copy) -> device array (shared arrays stay shared)

    def restore(entry):
        if not _is_entry(entry):
            return entry
        host, sharding = entry
        if id(host) not in back:
            back[id(host)] = jax.device_put(host, sharding)
        return back[id(host)]

    for i, (runner, tree, pools) in enumerate(zip(runners, slept.weights, slept.pools)):
        runner.state = jax.tree.map(restore, tree, is_leaf=_is_entry)
        if i == 0 and model is not None:
            nnx.update(model, runner.state)
        for name, spec in pools.items():
            setattr(runner, name, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), spec))
    jax.block_until_ready([r.state for r in runners])


__all__ = ["HOST_MEMORY_KIND", "Slept", "put_to_sleep", "wake_up"]
