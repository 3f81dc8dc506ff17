"""Optimizers and learning-rate schedules (optax).

Schedules (`lr_scheduler_type`), all with a linear warmup from 0 over `warmup_steps`:
    constant  lr after warmup
    linear    linear decay to final_lr_fraction * lr at the last step
    cosine    cosine decay to final_lr_fraction * lr at the last step
    wsd       warmup-stable-decay: lr until the last `cooldown_steps`, then linear to final_lr_fraction * lr
Weight decay applies to matrices only (kernels, embeddings, LoRA A/B), never to norm scales or biases.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from surojax.offload.optimizer import clipped_layerwise, has_layerwise_state, host_state_shardings, init_state_on_host
from surojax.parallel.zero import spread
from surojax.train.optim_8bit import Blockwise8bit, adamw_8bit
from surojax.train.optim_8bit_fused import FusedAdam8bit


def lr_schedule(kind: str, lr: float, total_steps: int, warmup_steps: int = 0, final_lr_fraction: float = 0.0,
                cooldown_steps: int = 0, xp=jnp) -> optax.Schedule:
    """The schedule as a function of the step. `xp`: the array module it computes with, jax.numpy (traced inside
    the optimizer) or numpy: the same float32 arithmetic on the host, for the learning rate the trainer logs
    (a jax.numpy call there would be queued on the device behind the step it was dispatched after, and wait
    for it)."""
    total_steps = max(int(total_steps), 1)
    warmup_steps = min(int(warmup_steps), total_steps)
    final = lr * final_lr_fraction
    decay_steps = max(total_steps - warmup_steps, 1)

    def schedule(step):
        step = xp.asarray(step, xp.float32)
        warm = lr * xp.minimum(1.0, (step + 1) / max(warmup_steps, 1)) if warmup_steps else lr
        t = xp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        if kind == "constant":
            after = xp.asarray(lr, xp.float32)
        elif kind == "linear":
            after = lr + (final - lr) * t
        elif kind == "cosine":
            after = final + (lr - final) * 0.5 * (1 + xp.cos(math.pi * t))
        elif kind == "wsd":
            cool = max(int(cooldown_steps), 1)
            tc = xp.clip((step - (total_steps - cool)) / cool, 0.0, 1.0)
            after = lr + (final - lr) * tc
        else:
            raise ValueError(f"lr_scheduler_type {kind!r} is unknown (constant, linear, cosine, wsd)")
        return xp.where(step < warmup_steps, warm, after)

    return schedule


DECAYED = ("kernel", "embedding", "lora_a", "lora_b")


def decay_mask(params):
    """True for matrices (by the name of the variable), False for norm scales and biases."""
    def leaf_mask(path, _):
        names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        names = [str(n) for n in names if n is not None]
        return any(n in DECAYED for n in names[-2:])
    return jax.tree_util.tree_map_with_path(leaf_mask, params)


def build_optimizer(name: str, schedule: optax.Schedule, *, weight_decay: float = 0.0, b1: float = 0.9,
                    b2: float = 0.999, eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                    offload_state: bool = False, offload_master: bool = False, layerwise_update: bool = False):
    """The optimizer the trainer applies to already-averaged gradients.

    offload_state: the stacked layers' state in pinned host memory, updated one layer at a time
    (surojax/offload/optimizer.py; the global-norm clip still sees every gradient).
    offload_master: the layers' fp32 master weights kept in the state, in pinned host memory, updated in the same
    per-layer loop; the params then hold the layers' compute copy (apply with `apply_master_updates`).
    layerwise_update: the same clipped, per-layer in-place update (`update_and_apply`) with everything on the device
    (the config key optimizer_layerwise: full fine-tuning with the parameters whole on every device). The whole-tree update holds
    several gradient-sized temporaries at once (grads / denom, clipped grads, updates, and adamw_8bit's dequantised
    moments and quantisation indices: ~40 bytes per layer parameter measured, issue 19); per layer, one layer's.
    The state is then a LayerwiseState (the layers' state stacked per layer + the other params' state). With
    adamw_8bit on the device the layers' update is one fused kernel pass per parameter on a GPU
    (surojax/train/optim_8bit_fused.py)."""
    if name not in ("adamw", "adamw_8bit"):
        raise ValueError(f"optimizer {name!r} is not available yet (adamw, adamw_8bit)")
    fused = None
    if name == "adamw_8bit":  # moments blockwise-quantised to 8 bits (surojax/train/optim_8bit.py)
        inner = adamw_8bit(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
        # its one-pass kernel update (in_place takes it on a GPU when the state and params are on the device)
        fused = FusedAdam8bit(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    else:
        inner = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    if offload_state or offload_master or layerwise_update:  # the chain below + its in-place per-layer update
        return clipped_layerwise(inner, offload=offload_state, master=offload_master, max_grad_norm=max_grad_norm,
                                 fused=fused)
    return optax.chain(*([optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []), inner)


def init_opt_state(optimizer, trainable, mesh, *, like=None, block_axes: tuple[str, ...] = ()):
    """Optimizer state placed like the parameters it mirrors (moments) or replicated (counts), created under
    jit, so a jitted step sees the same input shardings on every call and compiles once.

    like: the sharding tree (shaped like `trainable`) the moments follow instead of the parameters' own (ZeRO-1/2:
    split over data, surojax/parallel/zero.py). block_axes: mesh axes splitting the 8-bit state's blocks (the
    n_blocks dimension of codes and absmax, where each axis divides it; replicated without)."""
    param_sh = jax.tree.map(lambda x: x.sharding, trainable) if like is None else like
    abstract = jax.eval_shape(optimizer.init, trainable)
    replicated = NamedSharding(mesh, PartitionSpec())
    is_8bit = lambda x: isinstance(x, Blockwise8bit)  # noqa: E731 - [blocks, 256] codes: no parameter layout

    def like_param(x, s):
        return jax.tree.map(lambda a: spread(replicated, a.shape, block_axes, dims=(0,)), x) if is_8bit(x) else s

    if has_layerwise_state(abstract):  # offload_optimizer / _master: per-layer state [L, ...] built on the host
        shardings = host_state_shardings(jax.tree.map(lambda _: replicated, abstract))
        return init_state_on_host(optimizer, trainable, shardings)
    else:
        shardings = optax.tree_map_params(optimizer, like_param, abstract, param_sh,
                                          transform_non_params=lambda _: replicated, is_leaf=is_8bit)
    return jax.jit(optimizer.init, out_shardings=shardings)(trainable)
