"""`offload_optimizer`: the optimizer state of the stacked layers lives in pinned host memory and is updated one
layer at a time on the device.

    optimizer = chain(clip_by_global_norm, layerwise(adamw, offload=True))
    state of layerwise:  HostLayerwiseState(layers = adamw state of the trainable params under `layers` [L, ...]
                                                     (its parameter-shaped leaves in pinned_host),
                                            rest   = adamw state of the other params (embedding, head, norms)
                                                     on the device)
    update:  rest   inner.update on the device, as usual
             layers lax.scan over l: fetch layer l's state slice to the device, inner.update on layer l's
                    gradients / params / state, send the new state slice back to host memory (the scan stacks
                    it there); the updates come out stacked [L, ...] on the device

`inner` must be elementwise per parameter given its state (AdamW, adamw_8bit: true; global-norm clipping is not,
which is why the clip runs before, on the whole tree). The layers' state is `inner.init` vmapped over the layer
axis: one state per layer, every leaf (the step count too) stacked [L, ...], so the scan slices all of it.

The device then holds one layer's optimizer state at a time during the update (plus the non-layer params'
state), instead of 8 bytes per parameter (AdamW) for the whole model. The copies are host-to-device and back,
2 x 8 bytes per parameter per step (for Qwen3-8B ~130 GB at ~51 GB/s ~ 2.6 s per optimizer step): worth it
when it makes the run fit; amortise with gradient accumulation.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from surojax.offload.streaming import HOST_KIND, STREAMED_SUBTREE


class LayerwiseState(NamedTuple):
    layers: Any
    rest: Any


class HostLayerwiseState(NamedTuple):
    """LayerwiseState whose `layers` part is placed in pinned host memory (see `host_state_shardings`)."""

    layers: Any
    rest: Any


def _raw(tree) -> dict:
    return tree.raw_mapping if hasattr(tree, "raw_mapping") else tree  # nnx.State keeps plain dicts inside


def _split(tree):
    """(the `layers` subtree, the rest) of a params-like nnx.State / dict, as plain nested dicts."""
    raw = _raw(tree)
    if STREAMED_SUBTREE not in raw:
        raise ValueError(f"layerwise optimizer: the parameters have no {STREAMED_SUBTREE!r} subtree")
    return raw[STREAMED_SUBTREE], {k: v for k, v in raw.items() if k != STREAMED_SUBTREE}


def _join(layers, rest, like):
    return type(like)({**rest, STREAMED_SUBTREE: layers})


def _to(space, tree):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def layerwise(inner: optax.GradientTransformation, *, offload: bool) -> optax.GradientTransformation:
    """`inner` applied to the stacked layers one layer at a time under lax.scan (their state in host memory when
    `offload`), and to the other parameters at once."""
    state_cls = HostLayerwiseState if offload else LayerwiseState

    def init(params):
        layers, rest = _split(params)
        # one state per layer, stacked: every leaf (counts included) gets a leading [L] axis
        return state_cls(jax.vmap(inner.init)(layers), inner.init(rest))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("layerwise optimizer: update needs the params")
        g_layers, g_rest = _split(updates)
        p_layers, p_rest = _split(params)
        u_rest, s_rest = inner.update(g_rest, state.rest, p_rest)

        def body(carry, xs):
            g_l, p_l, s_l = xs
            if offload:
                s_l = _to(jax.memory.Space.Device, s_l)
            u_l, s_l = inner.update(g_l, s_l, p_l)
            if offload:
                s_l = _to(jax.memory.Space.Host, s_l)
            return carry, (u_l, s_l)

        _, (u_layers, s_layers) = jax.lax.scan(body, None, (g_layers, p_layers, state.layers))
        return _join(u_layers, u_rest, updates), state_cls(s_layers, s_rest)

    return optax.GradientTransformation(init, update)


def has_layerwise_state(state) -> bool:
    return any(isinstance(x, (LayerwiseState, HostLayerwiseState))
               for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, (LayerwiseState, HostLayerwiseState))))


def host_state_shardings(shardings):
    """The optimizer state's sharding tree with the `layers` part of every HostLayerwiseState in pinned host
    memory (all of it: every leaf is stacked per layer and fetched by the per-layer update)."""
    def fix(node):
        if isinstance(node, HostLayerwiseState):
            return HostLayerwiseState(jax.tree.map(lambda s: s.with_memory_kind(HOST_KIND), node.layers), node.rest)
        return node

    return jax.tree.map(fix, shardings, is_leaf=lambda x: isinstance(x, HostLayerwiseState))


def init_state_on_host(optimizer: optax.GradientTransformation, trainable, shardings):
    """The optimizer state with every (Host)LayerwiseState's per-layer part built on the host and placed by
    `shardings` (pinned memory for HostLayerwiseState), so the device never computes the whole [L, ...] state.

    The optimizer is initialised (jit, on the device) for a ONE-layer slice of the params; each per-layer leaf
    of that state ([1, ...]) is repeated L times on the host (every layer starts from the same state) and put
    with its host sharding; every other leaf is placed as `shardings` says."""
    import numpy as np

    layers, rest = _split(trainable)
    one_layer = jax.tree.map(lambda x: x[:1], layers)
    small = jax.jit(optimizer.init)(_join(one_layer, rest, trainable))
    abstract = jax.eval_shape(optimizer.init, trainable)
    is_lw = lambda x: isinstance(x, (LayerwiseState, HostLayerwiseState))  # noqa: E731

    def place(x, a, s):
        if is_lw(x):
            per_layer = jax.tree.map(
                lambda v, av, sv: jax.device_put(np.broadcast_to(np.asarray(v), av.shape), sv),
                x.layers, a.layers, s.layers)
            return type(x)(per_layer, jax.device_put(x.rest, s.rest))
        return jax.device_put(x, s)

    return jax.tree.map(place, small, abstract, shardings, is_leaf=is_lw)
