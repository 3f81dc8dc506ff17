"""The generic jitted training step: grad(loss o model) over accumulated micro-batches + the optimizer.

    step(trainable, frozen, opt_state, batch[A, B, T], rng, lr_scale=1.0) -> (trainable, opt_state, metrics)

The model is split once into (graphdef, trainable state, frozen state); only the trainable state is
differentiated and updated (the full model for full fine-tuning, the adapters for LoRA). Gradients of the
micro-batches' loss SUMS are accumulated (fp32) under `lax.scan` and divided once by the total count of
supervised tokens, so accumulation A x batch B gives the same update as batch A*B.

With `loss_guard` (auto_lr_reduction, surojax/train/loss_guard.py) `lr_scale` multiplies the optimizer's update
(for AdamW exactly a learning rate times lr_scale: the guard's cuts), and a step whose loss or gradient norm is not
finite leaves the parameters and the optimizer state as they were (metrics["skipped"] = 1). Without it the step
compiles neither (lr_scale is then ignored: it stays 1 without the guard).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Where the step puts its trees (ZeRO stages 1-2, surojax/parallel/zero.py); each a tree of NamedShardings
    with one leaf per array of what it places.

    params       the new parameters (the step's output: the inputs' layout, all-gathered after the update)
    opt_state    the new optimizer state (its inputs' layout)
    gradients    the fp32 accumulated gradients: each micro-batch's gradients are constrained to it before they
                 are added (split: reduce-scattered; like the params: all-reduced)
    update       the gradients and parameters the optimizer update reads (the optimizer state's split: each
                 device updates its shard)
    """
    params: Any
    opt_state: Any
    gradients: Any
    update: Any


def constrain(tree, shardings):
    """`jax.lax.with_sharding_constraint` leaf by leaf (`shardings`: the same leaves as `tree`; nnx Variables
    may differ in their metadata)."""
    leaves, treedef = jax.tree.flatten(tree)
    placed = jax.tree.leaves(shardings)
    if len(leaves) != len(placed):
        raise ValueError(f"{len(leaves)} arrays but {len(placed)} shardings")
    return treedef.unflatten([jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, placed)])


def make_train_step(graphdef, loss_fn: Callable, optimizer: optax.GradientTransformation, *,
                    prepare: Callable | None = None, donate: bool = True, jit: bool = True,
                    apply_updates: Callable = optax.apply_updates, loss_guard: bool = False,
                    shardings: StepShardings | None = None, fp8_delayed=None, weight_cache=None):
    """`loss_fn(model, micro_batch) -> (loss_sum, {"tokens": count, ...})`; the model runs its layers on the layer
    runner in `graphdef` (surojax/models/layer_runner.py, set by the layer-loop transform).
    Every other entry of the loss's metrics (any pytree of arrays, e.g. the MoE router stats under "router") is
    summed over the micro-batches in fp32 and returned in the step's metrics under its own key, undivided.

    `prepare(model, key)`, when given, runs on the merged model before each micro-batch's forward pass with
    a key distinct per step and micro-batch (LoRA dropout keys).
    `apply_updates(params, updates)`: offload_master passes surojax.offload.optimizer.apply_master_updates.
    An optimizer with `update_and_apply` (offload_optimizer / offload_master, and full fine-tuning's on-device
    `layerwise_update`: surojax/offload/optimizer.py) is given the gradient sums and their divisor and returns the
    new params itself (one layer at a time, in place); it takes no lr_scale (the config check refuses
    auto_lr_reduction with offload_optimizer / offload_master / optimizer_layerwise).
    `shardings` (ZeRO-1/2): the layouts the step constrains its gradients, update and outputs to; None: they
    follow the parameters (GSPMD propagation).
    `fp8_delayed` (a surojax.precision.fp8_delayed.DelayedScalingUpdate; fp8_scaling: delayed): the trainable
    state also holds FP8 amax probes and histories; they are split off before the optimizer (which never sees
    them: init its state on `fp8_delayed.split(trainable)[0]`), the probes' gradients (the amaxes each pass
    observed) are combined over the micro-batches by max and rolled into the histories after the step, so the
    scales of step t come from steps < t. The returned trainable state holds the new histories (checkpointed
    with it).
    `weight_cache` (surojax.precision.fp8_transform.Fp8WeightCaching; fp8_hybrid full fine-tuning, current or delayed
    scaling): `build(model)` runs once per step, before the micro-batches, on the step's parameters (not
    differentiated), and `attach(model, cache)` hands its result to each micro-batch's merged model: the weights
    are quantised once per step, not at every use.
    """
    place = (lambda tree, _: tree) if shardings is None else constrain  # noqa: E731

    def step(trainable, frozen, opt_state, batch, rng, lr_scale=1.0):
        probes = delayed = None
        if fp8_delayed is not None:
            trainable, probes, delayed = fp8_delayed.split(trainable)

        def merged(tr, pr):
            return nnx.merge(graphdef, tr, frozen, *((pr, delayed) if fp8_delayed else ()), copy=True)

        cache = None if weight_cache is None else weight_cache.build(merged(trainable, probes))

        def loss_of(tr, mb, index):
            tr, pr = tr
            model = merged(tr, pr)
            if weight_cache is not None:
                weight_cache.attach(model, cache)
            if prepare is not None:  # fresh Variables above: prepare() may set them
                prepare(model, jax.random.fold_in(rng, index))
            return loss_fn(model, mb)

        def grads_of(mb, index):
            (loss_sum, aux), (g, seen) = jax.value_and_grad(loss_of, has_aux=True)((trainable, probes), mb, index)
            return g, seen, loss_sum, aux

        def micro(carry, xs):
            g_acc, seen_acc, loss_acc, aux_acc = carry
            g, seen, loss_sum, aux = grads_of(*xs)
            g = place(jax.tree.map(lambda b: b.astype(jnp.float32), g), shardings and shardings.gradients)
            g_acc = place(jax.tree.map(lambda a, b: a + b, g_acc, g), shardings and shardings.gradients)
            if fp8_delayed is not None:  # amaxes: the max over the micro-batches, not a sum
                seen_acc = fp8_delayed.combine(seen_acc, seen)
            aux_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), aux_acc, aux)
            return (g_acc, seen_acc, loss_acc + loss_sum, aux_acc), None

        def finish(new_params, new_delayed=None):
            if fp8_delayed is None:
                return new_params
            return fp8_delayed.merge(new_params, probes, delayed if new_delayed is None else new_delayed)

        n_micro = jax.tree.leaves(batch)[0].shape[0]
        zero = jnp.zeros((), jnp.float32)
        in_place = getattr(optimizer, "update_and_apply", None)
        seen = None
        if in_place is not None and n_micro == 1:
            # one micro-batch: its gradients as they are (bf16 with offload_master, no fp32 copy of them all beside
            # them); the in-place update converts them layer by layer (the same fp32 values as the accumulator's)
            grads, seen, loss_sum, aux = grads_of(jax.tree.map(lambda x: x[0], batch), 0)
            loss_sum, aux = zero + loss_sum, jax.tree.map(lambda a: a.astype(jnp.float32), aux)
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
            zeros = place(zeros, shardings and shardings.gradients)
            aux_shapes = jax.eval_shape(loss_of, (trainable, probes), jax.tree.map(lambda x: x[0], batch), 0)[1]
            aux_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_shapes)  # (traced only)
            seen_zeros = None if probes is None else jax.tree.map(jnp.zeros_like, probes)  # amaxes are >= 0
            (grads, seen, loss_sum, aux), _ = jax.lax.scan(micro, (zeros, seen_zeros, zero, aux_zeros),
                                                           (batch, jnp.arange(n_micro)))
        count = aux.pop("tokens")
        denom = jnp.maximum(count, 1.0)
        metrics = {**aux, "loss": loss_sum / denom, "tokens": count}
        if in_place is not None:  # offload: divided, clipped and applied per layer, in place
            trainable, opt_state, metrics["grad_norm"] = in_place(grads, denom, opt_state, trainable)
            return finish(trainable, None if fp8_delayed is None else fp8_delayed.update(delayed, seen)), \
                opt_state, metrics
        grads = place(jax.tree.map(lambda g: g / denom, grads), shardings and shardings.update)
        metrics["grad_norm"] = optax.tree.norm(grads)
        params = place(trainable, shardings and shardings.update)  # ZeRO-1/2: this device's shard, sliced
        updates, new_state = optimizer.update(grads, opt_state, params)
        if loss_guard:
            updates = jax.tree.map(lambda u: u * jnp.asarray(lr_scale, u.dtype), updates)
        new_params = place(apply_updates(params, updates), shardings and shardings.params)  # all-gathered
        new_state = place(new_state, shardings and shardings.opt_state)
        new_delayed = None if fp8_delayed is None else fp8_delayed.update(delayed, seen)
        if loss_guard:
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            new_params, new_state = keep(new_params, trainable), keep(new_state, opt_state)
            if fp8_delayed is not None:  # a skipped step records no amaxes either
                new_delayed = keep(new_delayed, delayed)
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return finish(new_params, new_delayed), new_state, metrics

    if not jit:
        return step
    donated = (0, 2) if donate else ()
    if fp8_delayed is None:
        return jax.jit(step, donate_argnums=donated)
    return DelayedScalingStep(step, fp8_delayed, donated)


class DelayedScalingStep:
    """The step of fp8_scaling: delayed as two compiled programs, picked on the host: the first step of a run (no
    amax history yet) scales each tensor by its own amax, every later one by its history's scale
    (fp8_delayed.scale_source "own" / "history"). One program with a lax.cond per tensor would do both, but XLA GPU
    runs a conditional by reading its predicate back to the host and waiting for the stream: a pipeline drain per
    tensor, layer and micro-batch. Whether the histories are still empty is read from the input (one small
    reduction read back) unless the input is what the history program itself returned last (then they are filled:
    the steady state costs no read); a resumed run starts on the history program.

    Called like the jitted step; `.lower(*args)` lowers the program those arguments would run (the history one for
    abstract arguments)."""

    def __init__(self, step: Callable, fp8_delayed, donated: tuple[int, ...]):
        self.step = step  # the plain function (traced alone: one lax.cond per tensor, fp8_delayed's "either")
        self._fp8 = fp8_delayed

        def under(source):
            @functools.wraps(step)  # the compiled module keeps the step's name (jit_step: profiles, HLO dumps)
            def traced(*args, **kwargs):
                with fp8_delayed.scale_source(source):
                    return step(*args, **kwargs)
            return jax.jit(traced, donate_argnums=donated)

        self.first, self.later = under("own"), under("history")
        self.last = None  # the program the last call ran
        self._returned = []  # the histories the history program returned last: filled

    def program(self, trainable):
        """The compiled step these arguments run (`first` or `later`)."""
        leaves = jax.tree.leaves(trainable)
        if any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves):
            return self.later  # abstract (lowering for a memory or HLO check): the steady-state program
        histories = self._fp8.histories(trainable)
        if self._returned and len(histories) == len(self._returned) and all(
                a is b for a, b in zip(histories, self._returned)):
            return self.later
        return self.first if self._fp8.fresh(trainable) else self.later

    def __call__(self, trainable, *args, **kwargs):
        program = self.last = self.program(trainable)
        out = program(trainable, *args, **kwargs)
        self._returned = self._fp8.histories(out[0]) if program is self.later else []
        return out

    def lower(self, trainable, *args, **kwargs):
        return self.program(trainable).lower(trainable, *args, **kwargs)


def compiles_steady_next(step) -> bool:
    """Whether the step's last call ran a DelayedScalingStep's first-step program, so the next call compiles the
    steady one (the trainer and `bench train` say so / count it as compile time)."""
    return isinstance(step, DelayedScalingStep) and step.last is step.first


def steady_state(step):
    """The compiled program a run settles on, for benchmarks that time, profile or census one program: the history
    program of a DelayedScalingStep (its first step then starts every scale at 1, Transformer Engine's start, and
    fills the histories), else the step itself."""
    return step.later if isinstance(step, DelayedScalingStep) else step


def make_eval_step(graphdef, loss_fn: Callable):
    """The forward pass runs the layer runner in `graphdef` (the run's eval runner: surojax/offload/layer_loop.py)."""
    @jax.jit
    def eval_step(trainable, frozen, batch):
        model = nnx.merge(graphdef, trainable, frozen)
        loss_sum, aux = loss_fn(model, batch)
        return loss_sum, aux["tokens"]

    return eval_step
