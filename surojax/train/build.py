"""`build_run(spec, mesh)`: the one assembly of a training run, used by the Trainer, the bench and every task.

    spec ─ transforms (train/model_setup.run_transforms) ─ memory plan (their `memory` terms) ─ check it fits
         ─ model: load / initialise ─ the transforms in order (quantised base, LoRA, fp8 | nvfp4, MoE) inside the
           placement (mesh, host memory) ─ split by their trainable filter ─ optimizer + its state ─ layer loop
         ─ jitted train / eval steps (accumulate-and-update + the transforms' step hooks, train/step.py)

ZeRO (`spec.zero_stage`, surojax/parallel/zero.py): stages 1-2 place the optimizer state (and at 2 the accumulated
gradients) split over the data devices and constrain the step to that layout; 0 and 3 follow the parameters
(3 is the fsdp mesh). `Run.zero_summary` says the stage and the bytes per device.

The loss is a pure function `loss(model, batch, *, chunk) -> (loss_sum, {"tokens": ...})`
(default: the chunked LM loss); SFT, pretraining and the later tasks differ only in their data and this function.
A MoE model's training loss also gets `router=` (the router-loss weights) and returns its router stats.
Shapes: the train step takes batches [A, B, T] (A micro-batches of B rows of T tokens, B = rows per device x
the data-parallel devices); the eval step takes [B, T].
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import numpy as np
import optax
from flax import nnx

from surojax.compilation_cache import enable_compilation_cache
from surojax.losses.lm import lm_chunk_tokens, lm_loss
from surojax.models.decoder import Decoder
from surojax.models.layer_runner import Recompute
from surojax.models.transform import Transform, memory_settings, step_hooks, summary_lines
from surojax.offload.device_budget import placed_bytes, plans_one_device
from surojax.offload.layer_loop_choice import LayerLoopChoice, choose_layer_loop
from surojax.offload.memory_plan import MemoryPlan, check_fits, device_capacity, plan_memory
from surojax.offload.optimizer import apply_master_updates, compute_copy
from surojax.offload.layer_loop import LayerLoop
from surojax.offload.settings import OFFLOAD_AVAILABLE, prepare_host_memory
from surojax.parallel import batch_parallel_size
from surojax.parallel.pipeline import PipelineError, pipeline_stages, pipelined_layer_loop
from surojax.parallel.zero import ZeroLayout, ZeroStageError, plan_divisors, resolve_zero_stage, zero_layout
from surojax.quant import FORMATS
from surojax.train.model_setup import apply_model_transforms, build_model, run_transforms, trainable_filter
from surojax.train.optim import build_optimizer, init_opt_state, lr_schedule
from surojax.train.run_spec import RunSpec, TrainSetupError
from surojax.train.step import StepShardings, make_eval_step, make_train_step, single_hook

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """What a training loop needs: the split model, the optimizer and the jitted steps.

    train_step(trainable, frozen, opt_state, batch[A, B, T], rng) -> (trainable, opt_state, metrics)
    eval_step(trainable, frozen, batch[B, T]) -> (loss_sum, tokens)
    """
    spec: RunSpec
    mesh: object
    graphdef: nnx.GraphDef  # train mode (LoRA dropout on when it is set)
    eval_graphdef: nnx.GraphDef
    trainable: nnx.State
    frozen: nnx.State
    optimizer: optax.GradientTransformation
    opt_state: object
    lr_at: Callable[[int], float]  # the scheduled learning rate of a step, computed on the host (numpy): logged
    train_step: Callable
    eval_step: Callable
    chunk: int  # tokens per chunk of the chunked LM head
    memory_plan: MemoryPlan
    layer_loop: LayerLoop  # the layer-loop transform: the decoder's layer runner (offload/layer_loop.py)
    layer_loop_reason: str  # which recompute / unrolling the run uses, and why (the start-up summary)
    zero: ZeroLayout  # where params, gradients and optimizer state live (the resolved ZeRO stage)
    zero_summary: str  # the stage and the bytes per device of params / gradients / optimizer state (start-up)
    transform_lines: list = dataclasses.field(default_factory=list)  # (name, line) per transform (start-up)

    @property
    def model_config(self):
        return self.spec.model.config


def count_params(config) -> int:
    """Parameters of the architecture (an abstract model: nothing is allocated)."""
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def data_parallel_size(mesh) -> int:
    """Ways the batch is split: data x fsdp x expert (expert parallelism splits the batch like data parallelism)."""
    return batch_parallel_size(mesh)


def memory_plan_of(spec: RunSpec, chunk: int, *, recompute: Recompute | None = None,
                   unroll: int | bool | None = None, mesh=None,
                   transforms: list[Transform] | None = None) -> MemoryPlan:
    """Estimated peak device memory of the run (surojax/offload/memory_plan.py), per device, unsharded but for
    the ZeRO stage's split on `mesh` (None: one device); `recompute` / `unroll` replace the spec's (a candidate
    layer loop of `choose_layer_loop`). The transforms' terms are their `memory` settings (LoRA's rank and targets,
    the quantised base's bytes, FP8's weight cache, placement's host memory), over the model's own; `transforms`:
    the run's (None: made from the spec)."""
    mem, packed = spec.memory, spec.model.packed_experts
    divisors = {} if mesh is None else plan_divisors(resolve_zero_stage(spec.zero_stage, mesh), mesh)
    prequantized = spec.model.prequantized if spec.lora is not None else None
    own = dict(mode="full", recipe=spec.precision.recipe, batch=spec.batch.rows, seq=spec.batch.sequence_len,
               recompute=mem.recompute if recompute is None else recompute,
               unroll=mem.unroll if unroll is None else unroll,
               lm_chunk_tokens=chunk, optimizer=spec.optim.name, offload_optimizer=mem.offload_optimizer,
               master_dtype="fp32" if spec.precision.base == jax.numpy.float32 else "bf16",
               accum=spec.batch.accumulation, layerwise_update=mem.optimizer_layerwise,
               expert_weight_bytes=packed.bytes_per_value if packed is not None and packed.keep else None,
               kernel_weight_bytes=None if prequantized is None else FORMATS[prequantized].bytes_per_value(),
               vision_patches=spec.batch.image_patches, vision_frame_patches=spec.batch.image_frame_patches,
               train_vision=spec.model.train_vision, **divisors)
    transforms = run_transforms(spec, mesh) if transforms is None else transforms
    return plan_memory(spec.model.config, **{**own, **memory_settings(transforms)})


def resolve_layer_loop(spec: RunSpec, chunk: int, mesh=None) -> tuple[RunSpec, LayerLoopChoice]:
    """`recompute: auto` / `unroll_layers: auto` resolved by the memory plan (the fastest layer loop that fits the
    device, surojax/offload/layer_loop_choice.py); explicit values are kept and checked. The returned spec holds
    concrete values."""
    mem, transforms = spec.memory, run_transforms(spec, mesh)  # made once for every candidate's plan
    choice = choose_layer_loop(lambda r, u: memory_plan_of(spec, chunk, recompute=r, unroll=u, mesh=mesh,
                                                           transforms=transforms),
                               device_capacity(),
                               recompute=mem.recompute, unroll=mem.unroll, offload_base=mem.offload_base,
                               prefetch=mem.offload_prefetch)
    return spec.replace(memory=dataclasses.replace(mem, recompute=choice.recompute, unroll=choice.unroll)), choice


def placed_model(spec: RunSpec, transforms: list[Transform],
                 customize: Callable[[Decoder], None] | None = None) -> Decoder:
    """The model built and transformed in order: loaded / initialised, the transforms before the placement applied
    (then `customize`), all inside the placement's construction (offload/placement.py: a model built straight
    into its shards or host buffers never exists unplaced), then the ones after it (the layer loop)."""
    placement = next(t for t in transforms if t.name == "placement")
    at = transforms.index(placement)

    def make_model(shardings_of=None) -> Decoder:
        model = build_model(spec, shardings_of=shardings_of, transforms=[])
        apply_model_transforms(model, transforms[:at])
        if customize is not None:
            customize(model)
        return model

    model = placement.build(make_model)
    apply_model_transforms(model, transforms[at + 1:])  # the layer loop: the decoder's runner
    return model


def build_run(spec: RunSpec, mesh, *, loss: Callable = lm_loss, customize: Callable[[Decoder], None] | None = None,
              check_memory: bool = True) -> Run:
    """Assemble the run `spec` describes on `mesh`.

    The transforms (`model_setup.run_transforms`, models/transform.py's order) give the memory plan its terms, the
    model its changes, the split its trainable filter, the step its hooks and the start-up summary its lines
    (`Run.transform_lines`). customize(model): applied after the transforms before the placement, inside it (the
    bench swaps in a random quantised base). check_memory: refuse a run whose planned peak exceeds the device
    (unsharded meshes only: the plan is for one device holding everything).
    """
    prepare_host_memory(spec.memory.host_memory)
    cache_dir = enable_compilation_cache(mesh.devices.flat[0].platform)
    chunk = lm_chunk_tokens(spec.batch.rows * data_parallel_size(mesh), spec.batch.sequence_len,
                            spec.memory.lmhead_chunks)
    stage = resolve_zero_stage(spec.zero_stage, mesh)
    if stage in (1, 2) and (spec.memory.offload_optimizer or spec.memory.offload_master):
        raise ZeroStageError(f"zero_stage {stage} shards the optimizer state over the data devices; "
                             "offload_optimizer / offload_master keep it whole in host memory: drop one of the two")
    spec, choice = resolve_layer_loop(spec.replace(zero_stage=stage), chunk, mesh)
    mem, prec, plan = spec.memory, spec.precision, choice.plan
    reason = choice.reason
    if mem.unroll is True or (not isinstance(mem.unroll, bool) and mem.unroll > 1):
        reason += ("; unrolled layers compile longer the first time" +
                   (f" (compiled programs are cached in {cache_dir})" if cache_dir else ""))
    pipeline = None
    if pipeline_stages(mesh) > 1:  # the layers run as a microbatch schedule over the stages (parallel/pipeline.py)
        if spec.moe is not None:
            raise PipelineError("pipeline stages (parallel.stage > 1) do not collect the router statistics a MoE "
                                "model's training loss needs yet; use expert / data / fsdp parallelism for it")
        pipeline = pipelined_layer_loop(mesh, spec.pipeline, rows_per_shard=spec.batch.rows,
                                        num_layers=spec.model.config.num_layers,
                                        recompute=mem.recompute, unroll=mem.unroll)
    loop = LayerLoop(mem.recompute, mem.unroll, prefetch=mem.offload_prefetch, pipeline=pipeline, reason=reason)
    reason = loop.summary()
    log.debug("layer loop: %s", reason)  # the Trainer prints it in its start-up summary
    if check_memory and plans_one_device(mesh):
        check_fits(plan, device_capacity(), offload_available=OFFLOAD_AVAILABLE)

    transforms = [*run_transforms(spec, mesh), loop]  # models/transform.py's order: the layer loop last
    model = placed_model(spec, transforms, customize)
    train_mode = spec.lora is not None and spec.lora.adapter.dropout > 0
    if train_mode:
        model.train()
    trains = trainable_filter(spec, transforms)  # the vision tower left out unless train_vision
    graphdef, trainable, frozen = nnx.split(model, trains, ...)
    hooks = step_hooks(transforms)
    state = single_hook(hooks, "state")  # step state: carried, never optimised
    params = trainable if state is None else state.split(trainable)[0]
    model.eval()
    model.runner = loop.eval_runner
    eval_graphdef = nnx.split(model, trains, ...)[0]

    o = spec.optim
    schedule = lr_schedule(o.schedule, o.learning_rate, o.total_steps, o.warmup_steps, o.final_lr_fraction,
                           o.cooldown_steps)
    lr_at = lr_schedule(o.schedule, o.learning_rate, o.total_steps, o.warmup_steps, o.final_lr_fraction,
                        o.cooldown_steps, xp=np)
    optimizer = build_optimizer(o.name, schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                                max_grad_norm=o.max_grad_norm, offload_state=mem.offload_optimizer,
                                offload_master=mem.offload_master,
                                layerwise_update=layerwise_update(spec, mesh, stage))
    zero = zero_layout(stage, params, mesh)
    opt_state = init_opt_state(optimizer, params, mesh, like=zero.state, block_axes=zero.block_axes)
    summary = zero_summary(zero, mesh, params, frozen, opt_state)
    log.debug("zero: %s", summary)  # the Trainer prints it in its start-up summary
    apply = {}
    if mem.offload_master:  # the fp32 layers now live in the optimizer state (host); train their compute copy
        trainable = compute_copy(trainable, prec.compute)
        apply = {"apply_updates": apply_master_updates}
    del model  # the model's own references to replaced arrays (offload_master's fp32 layers) are dropped

    loss_fn = functools.partial(loss, chunk=chunk)
    # a MoE model trains with its router losses and reports its router stats (surojax.losses.router); eval is CE
    train_loss = loss_fn if spec.moe is None else functools.partial(loss_fn, router=spec.moe.router_loss)
    train_step = make_train_step(graphdef, train_loss, optimizer, hooks=hooks,
                                 loss_guard=o.loss_guard, shardings=_step_shardings(zero, opt_state), **apply)
    eval_step = make_eval_step(eval_graphdef, loss_fn)
    return Run(spec=spec, mesh=mesh, graphdef=graphdef, eval_graphdef=eval_graphdef, trainable=trainable, frozen=frozen,
               optimizer=optimizer, opt_state=opt_state, lr_at=lr_at, train_step=train_step,
               eval_step=eval_step, chunk=chunk, memory_plan=plan, layer_loop=loop,
               layer_loop_reason=reason, zero=zero, zero_summary=summary,
               transform_lines=summary_lines([t for t in transforms if t is not loop]))  # the loop: `layers`


def layerwise_update(spec: RunSpec, mesh, stage: int) -> bool:
    """`optimizer_layerwise: true`: full fine-tuning updates its layers in place, one at a time (build_optimizer's
    `layerwise_update`). The config check refuses it with LoRA, the loss guard (the in-place form takes no
    lr_scale), ZeRO stages 1-3 and parameter splits; a mesh that still splits the parameters is refused here.
    Opt-in, not automatic: the optimizer state's layout follows it, and a checkpoint must restore on any mesh."""
    if not spec.memory.optimizer_layerwise:
        return False
    if spec.lora is not None or spec.optim.loss_guard or stage != 0 or (
            mesh is not None and not (plans_one_device(mesh) and pipeline_stages(mesh) == 1)):
        raise TrainSetupError("optimizer_layerwise: the in-place per-layer update needs full fine-tuning, no "
                              "auto_lr_reduction, zero_stage 0 and parameters whole on every device")
    return True


def _step_shardings(zero: ZeroLayout, opt_state) -> StepShardings | None:
    """What the step constrains at ZeRO stages 1-2 (None at 0 and 3: the parameters' shardings propagate)."""
    if not zero.constrains_step:
        return None
    return StepShardings(params=zero.params, opt_state=jax.tree.map(lambda x: x.sharding, opt_state),
                         gradients=zero.gradients, update=zero.state)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def zero_summary(zero: ZeroLayout, mesh, trainable, frozen, opt_state) -> str:
    """One line: the ZeRO stage over the mesh and what one device holds of the parameters (trainable + frozen),
    the fp32 accumulated gradients and the optimizer state (host-resident state included)."""
    over = {0: "replicated over data", 1: "optimizer state split over data", 2: "optimizer state and gradients "
            "split over data", 3: "parameters, gradients and optimizer state split over fsdp"}[zero.stage]
    n = mesh.shape["fsdp"] if zero.stage == 3 else mesh.shape["data"]
    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    params = placed_bytes(trainable, sharding_of(trainable)) + placed_bytes(frozen, sharding_of(frozen))
    grads = placed_bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.float32), trainable),
                         zero.gradients)
    state = placed_bytes(opt_state, sharding_of(opt_state))
    return (f"ZeRO stage {zero.stage} ({over}, {n} device(s)); per device: params {_mib(params)}, gradients "
            f"{_mib(grads)}, optimizer state {_mib(state)}")
