"""Random weights of a real shape built on the host and placed straight where they will live (benchmarks).

A model larger than the device cannot be initialised on it (`init_sharded` computes every weight on the device).
`random_placed_model` takes the ABSTRACT model (`nnx.eval_shape` of the trainer's own `build_model`, LoRA
included), optionally swaps the base kernels for a GGUF block format, and fills each Variable leaf by leaf
with numpy values that `jax.device_put` sends to its final sharding: the stacked base into `pinned_host`
memory when it is streamed, everything else to the device. The device never holds the streamed base.

Values (throughput does not depend on them, only finiteness matters):
    norm scales 1; LoRA B 0 (as a fresh adapter); everything else uniform in +-[2^-7, 2^-6) (bf16: random
    sign and mantissa bits under a fixed exponent, no float arithmetic); GGUF blocks: random quant bytes
    with every block's fp16 scale set to 2^-8. A stacked [L, ...] leaf repeats one random layer L times
    (cheap to build on the host; every layer still has its own memory and is streamed as such).
"""
from __future__ import annotations

from typing import Callable

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from surojax.offload.streaming import _on_host, host_memory_kind

RANDOM_GGUF = ("q4_0", "q5_0", "q8_0")  # block types whose scale is one fp16 `d` in bytes 0:2 of each block
_SCALE_F16 = np.float16(2.0 ** -8).view(np.uint16)


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


def _gguf_blocks(data: np.ndarray, type_size: int) -> np.ndarray:
    """Set every block's fp16 scale (bytes 0:2) of random GGUF bytes to a small finite value (in place)."""
    blocks = data.reshape(-1, type_size)
    blocks[:, 0:2] = np.frombuffer(_SCALE_F16.tobytes(), np.uint8)
    return data


def quantized_abstract(model, fmt: str) -> None:
    """Swap the base kernels of an abstract model for abstract GGUF block pytrees of `fmt` (in place)."""
    from surojax.models.registry import LINEAR_MODULES
    from surojax.peft.lora import base_linear
    from surojax.quant import FORMATS
    from surojax.quant.transform import QuantParam

    if fmt not in RANDOM_GGUF:
        raise ValueError(f"random quantised bases are built for {', '.join(RANDOM_GGUF)}, not {fmt!r}")
    cls = FORMATS[fmt]
    for name in LINEAR_MODULES:
        lin = base_linear(model, name)
        L, K, N = lin.kernel.get_value().shape
        data = jax.ShapeDtypeStruct((L, N, K // cls.block_size * cls.type_size), np.uint8)
        lin.kernel = QuantParam(cls(data=data, shape=(K, N)), **lin.kernel.get_metadata())


def random_placed_model(make_model: Callable[[], nnx.Module], mesh, *, offload_base: bool,
                        base_format: str | None = None, seed: int = 0) -> nnx.Module:
    """`make_model()`'s structure (traced abstractly: nothing allocated) with random values built on the host and
    placed leaf by leaf: the stacked frozen base in pinned host memory when `offload_base`, the rest on the
    device by the parameter rules."""
    from surojax.parallel import param_shardings
    from surojax.quant import FORMATS

    abstract = nnx.eval_shape(make_model)
    if base_format:
        quantized_abstract(abstract, base_format)
    graphdef, state = nnx.split(abstract)
    shardings = nnx.to_flat_state(param_shardings(state, mesh))
    kind = host_memory_kind(mesh.devices.flat[0]) if offload_base else None
    rng = np.random.default_rng(seed)
    flat = []
    for (path, var), (_, sh) in zip(nnx.to_flat_state(state), shardings):
        name = ".".join(map(str, path))
        stacked = path[0] == "layers"
        host = offload_base and _on_host(path, var, embedding=not abstract.cfg.tie_word_embeddings)
        fmt_cls = FORMATS.get(base_format) if base_format else None

        def make(x, s):
            value = random_leaf(rng, tuple(x.shape), x.dtype, stacked=stacked, name=name)
            if fmt_cls is not None and x.dtype == np.uint8 and path[-1] == "kernel":
                value = _gguf_blocks(value, fmt_cls.type_size)
            out = jax.device_put(value, s.with_memory_kind(kind) if host else s)
            del value
            return out

        flat.append((path, var.replace(jax.tree.map(make, var.get_value(), sh.get_value()))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
