"""The memory of `surojax bench train`'s step as XLA compiles it, without building anything (issue 6).

    step_memory(BenchConfig(shape="qwen3-8b", mode="full", offload_optimizer=True, ...), layers=4)
        -> {"device_argument": ..., "host_argument": ..., "temp": ..., "device_peak": ..., ...}   (bytes)

The model is traced with nnx.eval_shape, the optimizer state with jax.eval_shape; every argument of the jitted
step (train_bench.build's own `make_train_step`, donated as there) becomes a jax.ShapeDtypeStruct carrying its
sharding and memory kind (the layers' optimizer state / master in pinned_host as `init_opt_state` places them,
the offload_master compute copy bf16). `.lower(...).compile().memory_analysis()` then gives XLA's buffer
assignment of the real program: arguments, outputs not aliased to a donated argument, and temporaries.

`layers` reduces the depth (8B widths at 2-8 layers compile in seconds on a CPU); per-layer figures scale by L.
On the CPU backend the host memory space is ordinary memory, so `temp` counts host temporaries too (XLA's CPU
compiler reports no separate host figures) and a few of its fusions differ from the GPU's: it is a check of
the program's structure (what grows with L) and an estimate, the H200 run is the measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from surojax.bench.shapes import model_config, shape_hf_config
from surojax.bench.train_bench import BenchConfig, bench_spec, memory_plan
from surojax.losses.lm import lm_chunk_tokens, lm_loss
from surojax.models.config import ModelConfig
from surojax.offload.optimizer import apply_master_updates, has_layerwise_state, host_state_shardings
from surojax.models.layer_runner import LayerScan
from surojax.parallel import make_mesh, param_shardings
from surojax.train.build import layerwise_update, resolve_layer_loop
from surojax.train.model_setup import build_model, trainable_filter
from surojax.train.optim import build_optimizer, lr_schedule
from surojax.train.optim_8bit import Blockwise8bit
from surojax.train.step import make_train_step

GiB = 2 ** 30


def abstract_step_args(bc, *, layers: int | None = None):
    """(step, args): train_bench's jitted step and ShapeDtypeStructs of (trainable, frozen, opt_state, batch, key)
    for BenchConfig `bc` (mode full; `layers` overrides the depth)."""
    if bc.mode != "full":
        raise ValueError("step_memory: --mode full only (LoRA's streamed base is measured on the device)")
    spec = bench_spec(bc)
    if layers is not None:
        config = ModelConfig.from_hf(dict(shape_hf_config(bc.shape), num_hidden_layers=layers))
        spec = spec.replace(model=dataclasses.replace(spec.model, config=config))
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    chunk = lm_chunk_tokens(bc.batch, bc.seq, bc.lmhead_chunks)
    spec, _ = resolve_layer_loop(spec, chunk, mesh)  # `auto` as build_run resolves it
    model = nnx.eval_shape(lambda: build_model(spec))
    model.runner = LayerScan(spec.memory.recompute, spec.memory.unroll)
    graphdef, trainable, frozen = nnx.split(model, trainable_filter(spec), ...)
    o = spec.optim
    schedule = lr_schedule("constant", o.learning_rate, 10**6)
    optimizer = build_optimizer(o.name, schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                                max_grad_norm=o.max_grad_norm, offload_state=bc.offload_optimizer,
                                offload_master=bc.offload_master,
                                layerwise_update=layerwise_update(spec, mesh, 0))
    replicated = NamedSharding(mesh, P())
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    param_sh = param_shardings(trainable, mesh)
    abstract_state = jax.eval_shape(optimizer.init, trainable)
    if has_layerwise_state(abstract_state):
        state_sh = host_state_shardings(jax.tree.map(lambda _: replicated, abstract_state))
    else:
        is_8bit = lambda x: isinstance(x, Blockwise8bit)  # noqa: E731 - adamw_8bit's codes: replicated
        state_sh = optax.tree_map_params(
            optimizer, lambda x, s: jax.tree.map(lambda _: replicated, x) if is_8bit(x) else s, abstract_state,
            param_sh, transform_non_params=lambda _: replicated, is_leaf=is_8bit)
    opt_state = jax.tree.map(sds, abstract_state, state_sh)
    tr = jax.tree.map(sds, trainable, param_sh)
    kw = {}
    if bc.offload_master:  # the layers train their compute copy (offload.optimizer.compute_copy)
        compute = spec.precision.compute
        raw = tr.raw_mapping if hasattr(tr, "raw_mapping") else tr
        raw["layers"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute, sharding=x.sharding)
                                     if jnp.issubdtype(x.dtype, jnp.floating) else x, raw["layers"])
        kw["apply_updates"] = apply_master_updates
    fr = jax.tree.map(lambda x: sds(x, replicated), frozen)

    step = make_train_step(graphdef, functools.partial(lm_loss, chunk=chunk), optimizer, **kw)
    shape = (bc.accum, bc.batch, bc.seq)
    bsh = NamedSharding(mesh, P(None, None, None))
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=bsh)
             for k in ("tokens", "positions", "segment_ids", "targets", "loss_mask")}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    return step, (tr, fr, opt_state, batch, key)


def _host_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)
                   if getattr(x.sharding, "memory_kind", None) == "pinned_host"))


def step_memory(bc, *, layers: int | None = None) -> dict:
    """XLA's memory figures (bytes) of the compiled step: arguments split by memory space, temporaries, outputs
    not aliased to a donated argument, and device_peak = device arguments + temp + unaliased outputs."""
    step, args = abstract_step_args(bc, layers=layers)
    ma = step.lower(*args).compile().memory_analysis()
    host_arg = _host_bytes(args)
    out = {"argument": ma.argument_size_in_bytes, "host_argument": host_arg,
           "device_argument": ma.argument_size_in_bytes - host_arg, "temp": ma.temp_size_in_bytes,
           "output_not_aliased": ma.output_size_in_bytes - ma.alias_size_in_bytes,
           "host_temp": ma.host_temp_size_in_bytes}
    out["device_peak"] = out["device_argument"] + out["temp"] + out["output_not_aliased"]
    return out


def scaled(bc, *, depths=(2, 4)) -> dict:
    """step_memory at two reduced depths, extrapolated linearly to the shape's own depth (bytes per figure)."""
    a, b = (step_memory(dataclasses.replace(bc), layers=d) for d in depths)
    L = model_config(bc.shape).num_layers
    return {k: a[k] + (b[k] - a[k]) * (L - depths[0]) / (depths[1] - depths[0]) for k in a}


def main(argv=None) -> int:
    """Print the compiled step's memory (scaled from two reduced depths) next to the memory plan, in GiB."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--depths", default="4,8", help="two reduced depths to compile at (default 4,8)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lmhead-chunks", type=int, default=4)
    args = ap.parse_args(argv)
    depths = tuple(int(d) for d in args.depths.split(","))
    for name, keys in (("offload-opt", dict(offload_optimizer=True)),
                       ("offload-opt-master", dict(offload_optimizer=True, offload_master=True))):
        bc = BenchConfig(shape=args.shape, mode="full", batch=1, seq=args.seq, lmhead_chunks=args.lmhead_chunks,
                         recompute="full", **keys)
        figures = {k: round(v / GiB, 2) for k, v in scaled(bc, depths=depths).items()}
        plan = memory_plan(bc)
        print(json.dumps({"name": name, "shape": args.shape, "compiled_gib": figures,
                          "plan_gib": round(plan.total / GiB, 2), "plan_host_gib": round(plan.host / GiB, 2)}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
