"""The generic jitted training step: accumulate-and-update. grad(loss o model) over accumulated micro-batches + the
optimizer, with the transforms' step hooks (surojax.models.transform.StepHooks) plugged in where they act.

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
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from surojax.models.transform import StepHooks


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


def single_hook(hooks: Sequence[StepHooks], field: str):
    """The one hook of this kind among `hooks` (None if none); two are refused (models/transform.py)."""
    found = [getattr(h, field) for h in hooks if getattr(h, field) is not None]
    if len(found) > 1:
        raise ValueError(f"two transforms give the training step a {field!r} hook; the step takes one")
    return found[0] if found else None


def make_train_step(graphdef, loss_fn: Callable, optimizer: optax.GradientTransformation, *,
                    hooks: Sequence[StepHooks] = (), donate: bool = True, jit: bool = True,
                    apply_updates: Callable = optax.apply_updates, loss_guard: bool = False,
                    shardings: StepShardings | None = None):
    """`loss_fn(model, micro_batch) -> (loss_sum, {"tokens": count, ...})`; the model runs its layers on the layer
    runner in `graphdef` (surojax/models/layer_runner.py, set by the layer-loop transform).
    Every other entry of the loss's metrics (any pytree of arrays, e.g. the MoE router stats under "router") is
    summed over the micro-batches in fp32 and returned in the step's metrics under its own key, undivided.

    `hooks`: the transforms' `StepHooks` (surojax.models.transform), in the transforms' order:
      state         (one at most) split off the trainable state before the optimizer, which never sees it (init
                    the optimizer's state on `state.split(trainable)[0]`); its observers are differentiated with
                    the parameters, their gradients combined over the micro-batches (`combine`) and handed to
                    `update` after the step (a step the loss guard skips keeps the old state); the returned
                    trainable state holds the new state (checkpointed with it)
      before_step   run once per step on the step's merged model (not differentiated); its value reaches
      before_micro  run on each micro-batch's merged model before its forward pass, with a key distinct per step
                    and micro-batch (dropout and stochastic-rounding keys, the per-step FP8 weights attached)
      compile       (one at most) compiles the step in place of `jax.jit`
    `apply_updates(params, updates)`: offload_master passes surojax.offload.optimizer.apply_master_updates.
    An optimizer with `update_and_apply` (offload_optimizer / offload_master, and full fine-tuning's on-device
    `layerwise_update`: surojax/offload/optimizer.py) is given the gradient sums and their divisor and returns the
    new params itself (one layer at a time, in place); it takes no lr_scale (the config check refuses
    auto_lr_reduction with offload_optimizer / offload_master / optimizer_layerwise).
    `shardings` (ZeRO-1/2): the layouts the step constrains its gradients, update and outputs to; None: they
    follow the parameters (GSPMD propagation).
    """
    place = (lambda tree, _: tree) if shardings is None else constrain  # noqa: E731
    state = single_hook(hooks, "state")
    compile_step = single_hook(hooks, "compile")
    per_step = [h for h in hooks if h.before_step is not None or h.before_micro is not None]

    def step(trainable, frozen, opt_state, batch, rng, lr_scale=1.0):
        observers = carried = None
        if state is not None:
            trainable, observers, carried = state.split(trainable)

        def merged(tr, obs):
            return nnx.merge(graphdef, tr, frozen, *((obs, carried) if state is not None else ()), copy=True)

        values = [None if h.before_step is None else h.before_step(merged(trainable, observers)) for h in per_step]

        def loss_of(tr, mb, index):
            tr, obs = tr
            model = merged(tr, obs)  # fresh Variables: the hooks may set them
            for h, value in zip(per_step, values):
                if h.before_micro is not None:
                    h.before_micro(model, jax.random.fold_in(rng, index), value)
            return loss_fn(model, mb)

        def grads_of(mb, index):
            (loss_sum, aux), (g, seen) = jax.value_and_grad(loss_of, has_aux=True)((trainable, observers), mb, index)
            return g, seen, loss_sum, aux

        def micro(carry, xs):
            g_acc, seen_acc, loss_acc, aux_acc = carry
            g, seen, loss_sum, aux = grads_of(*xs)
            g = place(jax.tree.map(lambda b: b.astype(jnp.float32), g), shardings and shardings.gradients)
            g_acc = place(jax.tree.map(lambda a, b: a + b, g_acc, g), shardings and shardings.gradients)
            if state is not None:  # observations combine as the state says (amaxes: their max), not summed
                seen_acc = state.combine(seen_acc, seen)
            aux_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), aux_acc, aux)
            return (g_acc, seen_acc, loss_acc + loss_sum, aux_acc), None

        def finish(new_params, new_carried=None):
            if state is None:
                return new_params
            return state.merge(new_params, observers, carried if new_carried is None else new_carried)

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
            aux_shapes = jax.eval_shape(loss_of, (trainable, observers), jax.tree.map(lambda x: x[0], batch), 0)[1]
            aux_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_shapes)  # (traced only)
            seen_zeros = None if observers is None else jax.tree.map(jnp.zeros_like, observers)  # combine's identity
            (grads, seen, loss_sum, aux), _ = jax.lax.scan(micro, (zeros, seen_zeros, zero, aux_zeros),
                                                           (batch, jnp.arange(n_micro)))
        count = aux.pop("tokens")
        denom = jnp.maximum(count, 1.0)
        metrics = {**aux, "loss": loss_sum / denom, "tokens": count}
        if in_place is not None:  # offload: divided, clipped and applied per layer, in place
            trainable, opt_state, metrics["grad_norm"] = in_place(grads, denom, opt_state, trainable)
            return finish(trainable, None if state is None else state.update(carried, seen)), opt_state, metrics
        grads = place(jax.tree.map(lambda g: g / denom, grads), shardings and shardings.update)
        metrics["grad_norm"] = optax.tree.norm(grads)
        params = place(trainable, shardings and shardings.update)  # ZeRO-1/2: this device's shard, sliced
        updates, new_state = optimizer.update(grads, opt_state, params)
        if loss_guard:
            updates = jax.tree.map(lambda u: u * jnp.asarray(lr_scale, u.dtype), updates)
        new_params = place(apply_updates(params, updates), shardings and shardings.params)  # all-gathered
        new_state = place(new_state, shardings and shardings.opt_state)
        new_carried = None if state is None else state.update(carried, seen)
        if loss_guard:
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            new_params, new_state = keep(new_params, trainable), keep(new_state, opt_state)
            if state is not None:  # a skipped step records no observations either
                new_carried = keep(new_carried, carried)
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return finish(new_params, new_carried), new_state, metrics

    if not jit:
        return step
    donated = (0, 2) if donate else ()
    if compile_step is None:
        return jax.jit(step, donate_argnums=donated)
    return compile_step(step, donated)


def compiles_steady_next(step) -> bool:
    """Whether the step's last call ran a first-step program of a `compile` hook (FP8 delayed scaling's), so the
    next call compiles the steady one (the trainer and `bench train` say so / count it as compile time)."""
    return bool(getattr(step, "compiles_next", False))


def steady_state(step):
    """The compiled program a run settles on, for benchmarks that time, profile or census one program: a
    `compile` hook's `steady` program (FP8 delayed scaling's history program), else the step itself."""
    return getattr(step, "steady", step)


def make_eval_step(graphdef, loss_fn: Callable):
    """The forward pass runs the layer runner in `graphdef` (the run's eval runner: surojax/offload/layer_loop.py)."""
    @jax.jit
    def eval_step(trainable, frozen, batch):
        model = nnx.merge(graphdef, trainable, frozen)
        loss_sum, aux = loss_fn(model, batch)
        return loss_sum, aux["tokens"]

    return eval_step
