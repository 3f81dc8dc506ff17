"""Random weights of a real shape built on the host and placed straight where they will live (benchmarks).

A model larger than the device cannot be initialised on it (`init_sharded` computes every weight on the device).
`random_placed_model` takes the ABSTRACT model (`nnx.eval_shape` of the caller's `make_model`: the trainer's own
`build_model`, LoRA included, and a quantised base when `make_model` swaps one in with
`bench.quant_base.randomize_base`) and fills each Variable leaf by leaf with numpy values that `jax.device_put`
sends to its final sharding: the stacked base into `pinned_host` memory when it is streamed, everything else to
the device. The device never holds the streamed base.

Values (throughput does not depend on them, only finiteness matters):
    norm scales 1; LoRA B 0 (as a fresh adapter); everything else uniform in +-[2^-7, 2^-6) (bf16: random
    sign and mantissa bits under a fixed exponent, no float arithmetic); a quantised weight: one layer of
    `quant.random_weights.random_weight` (random codes, sane scales; the one builder of random quantised weights),
    run on the CPU backend. A stacked [L, ...] leaf repeats one random layer L times (cheap to build on the host; every
    layer still has its own memory and is streamed as such).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from surojax.offload.host_layers import split_layers
from surojax.offload.streaming import _on_host, build_context, host_memory_kind
from surojax.parallel import param_shardings
from surojax.quant.base import QuantFormat
from surojax.quant.random_weights import random_weight


def _random_layer(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.uint8:
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    if np.issubdtype(dtype, np.integer):
        return np.zeros(shape, dtype)
    if dtype == np.dtype(ml_dtypes.bfloat16):
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        return ((bits & 0x807F) | 0x3C00).view(ml_dtypes.bfloat16)  # sign, 7 mantissa bits; exponent 2^-7
    sign = rng.integers(0, 2, size=shape, dtype=np.int8) * 2 - 1
    return (sign * (1.0 + rng.random(size=shape, dtype=np.float32)) * 2.0 ** -7).astype(dtype)


def random_leaf(rng: np.random.Generator, shape: tuple, dtype, *, stacked: bool, name: str) -> np.ndarray:
    """One leaf's host values; `stacked` repeats one random [1, ...] layer over the leading layers axis."""
    if name.endswith("scale"):
        return np.ones(shape, dtype)
    if name.endswith("lora_b"):
        return np.zeros(shape, dtype)
    if stacked and len(shape) >= 2:
        layer = _random_layer(rng, (1, *shape[1:]), dtype)
        return np.ascontiguousarray(np.broadcast_to(layer, shape))
    return _random_layer(rng, shape, dtype)


@functools.cache
def _one_random_layer(fmt: str, k: int, n: int) -> Callable:
    """jit of `random_weight` for one layer ([1, ...] leaves) of a [K, N] weight in `fmt`."""
    return jax.jit(lambda key: random_weight(fmt, k, n, key, (1,)))


def random_quant_value(abstract, seed: int, index: int):
    """Host values of an abstract stacked quantised weight (a QuantFormat of [L, ...] leaves): one random layer
    built by `random_weight` on the CPU backend (key `fold_in(key(seed), index)`), repeated over the
    leading layers axis; numpy leaves."""
    k, n = abstract.shape
    with build_context(offload_base=True):  # the CPU backend (the default device when there is none)
        one = _one_random_layer(abstract.name, k, n)(jax.random.fold_in(jax.random.key(seed), index))
    return jax.tree.map(lambda layer, x: np.ascontiguousarray(np.broadcast_to(np.asarray(layer), x.shape)),
                        one, abstract)


def random_placed_model(make_model: Callable[[], nnx.Module], mesh, *, offload_base: bool,
                        seed: int = 0, per_layer: bool = False) -> nnx.Module:
    """`make_model()`'s structure (traced abstractly: nothing allocated) with random values built on the host and
    placed leaf by leaf: the stacked frozen base in pinned host memory when `offload_base` (as per-layer host
    buffers, `HostLayers`, with `per_layer`: offload_prefetch), the rest on the device by the parameter rules."""
    abstract = nnx.eval_shape(make_model)
    graphdef, state = nnx.split(abstract)
    shardings = nnx.to_flat_state(param_shardings(state, mesh))
    kind = host_memory_kind(mesh.devices.flat[0]) if offload_base else None
    rng = np.random.default_rng(seed)
    flat = []
    for i, ((path, var), (_, sh)) in enumerate(zip(nnx.to_flat_state(state), shardings)):
        name = ".".join(map(str, path))
        stacked = path[0] == "layers"
        host = offload_base and _on_host(path, var, embedding=not abstract.cfg.tie_word_embeddings)

        def host_values(value):
            if not isinstance(value, QuantFormat):
                return jax.tree.map(lambda x: random_leaf(rng, tuple(x.shape), x.dtype, stacked=stacked, name=name),
                                    value)
            if not stacked:
                raise ValueError(f"{name}: random quantised weights are built for the stacked layers only")
            return random_quant_value(value, seed, i)

        def put(x, s):
            if host and per_layer and stacked:
                return split_layers(x, s.with_memory_kind(kind))
            return jax.device_put(x, s.with_memory_kind(kind) if host else s)

        flat.append((path, var.replace(jax.tree.map(put, host_values(var.get_value()), sh.get_value()))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
