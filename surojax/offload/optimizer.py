"""`offload_optimizer` / `offload_master`: the optimizer state and / or the fp32 master weights of the stacked layers
live in pinned host memory and are updated one layer at a time on the device.

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
2 x 8 bytes per parameter per step (for Qwen3-8B ~130 GB, seconds per optimizer step at the host link's
bandwidth: benchmarks/RESULTS.md#s4-master): worth it when it makes the run fit; amortise with gradient accumulation.

`master=True` (offload_master, full fine-tuning with the bf16 recipe): the state also holds `master`, the fp32
master weights of the layers [L, ...], always in pinned host memory; the trainable params' `layers` are then the
bf16 COMPUTE copy on the device (what the forward / backward read: the cast they did at each use of an fp32
param is now done once, at the update). The same scan fetches layer l's master (and state, when offloaded),
runs the update in fp32 against the master (weight decay reads the master, as in the resident run), sends the
new master back to host and emits the layer's new bf16 copy. The `layers` part of the "updates" it returns are
therefore the NEW PARAMS, not deltas: apply them with `apply_master_updates` (make_train_step's
`apply_updates`). Independent of offload_optimizer: either, both or neither part may be on host.
Per step this moves 2 x 4 bytes per layer parameter more over the host link (~56 GB for Qwen3-8B).

In the train step (`clipped_layerwise`, what build_optimizer returns): `update_and_apply` (`in_place`) runs the
same per-layer update as a fori_loop that also divides / clips layer l's gradients and writes layer l's new
params, state and master into the donated buffers it carries, so the step holds the gradients once and nothing
else of the size of all layers (the whole-tree form: ~5 gradient-sized copies; docs/memory.md has the figures).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from surojax.offload.streaming import HOST_KIND, STREAMED_SUBTREE


class LayerwiseState(NamedTuple):
    layers: Any
    rest: Any
    master: Any = None  # offload_master: the fp32 master weights of the layers [L, ...], in pinned host memory


class HostLayerwiseState(NamedTuple):
    """LayerwiseState whose `layers` part is placed in pinned host memory (see `host_state_shardings`)."""

    layers: Any
    rest: Any
    master: Any = None


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


def _fetch(s_l, m_l, *, offload: bool):
    """Layer l's state slice (when offloaded) and master slice (always host) copied to the device."""
    return (_to(jax.memory.Space.Device, s_l) if offload else s_l,
            None if m_l is None else _to(jax.memory.Space.Device, m_l))


def _send(s_l, m_l, *, offload: bool):
    """The new state / master slices sent back to host memory (where they live)."""
    return (_to(jax.memory.Space.Host, s_l) if offload else s_l,
            None if m_l is None else _to(jax.memory.Space.Host, m_l))


def _layer_update(inner, g_l, p_l, s_l, m_l):
    """One layer's update on the device: (what `update` returns for the layer, its new state, its new master).
    With a master (m_l not None) the update runs in fp32 against the master and the first output is the layer's
    new compute copy (cast to p_l's dtype); else it is the update (delta) of p_l."""
    if m_l is None:
        out_l, s_l = inner.update(g_l, s_l, p_l)
        return out_l, s_l, None
    u_l, s_l = inner.update(g_l, s_l, m_l)
    # the update materialised (rounded to fp32) before it is added, as when apply_updates runs after
    # the loop: without the barrier XLA fuses the add into the update and the master drifts by an ulp
    u_l = jax.lax.optimization_barrier(u_l)
    m_l = optax.apply_updates(m_l, u_l)
    return jax.tree.map(lambda m, p: m.astype(p.dtype), m_l, p_l), s_l, m_l


def layerwise(inner: optax.GradientTransformation, *, offload: bool, master: bool = False
              ) -> optax.GradientTransformation:
    """`inner` applied to the stacked layers one layer at a time under lax.scan (their state in host memory when
    `offload`; their fp32 master weights kept in the state, in host memory, when `master`), and to the other
    parameters at once. `init` must see the fp32 params (the master values)."""
    state_cls = HostLayerwiseState if offload else LayerwiseState

    def init(params):
        layers, rest = _split(params)
        m = jax.tree.map(lambda p: p.astype(jnp.float32), layers) if master else None
        # one state per layer, stacked: every leaf (counts included) gets a leading [L] axis
        return state_cls(jax.vmap(inner.init)(layers if m is None else m), inner.init(rest), m)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("layerwise optimizer: update needs the params")
        g_layers, g_rest = _split(updates)
        p_layers, p_rest = _split(params)
        u_rest, s_rest = inner.update(g_rest, state.rest, p_rest)

        def body(carry, xs):
            g_l, p_l, s_l, m_l = xs
            out_l, s_l, m_l = _layer_update(inner, g_l, p_l, *_fetch(s_l, m_l, offload=offload))
            return carry, (out_l, *_send(s_l, m_l, offload=offload))

        xs = (g_layers, p_layers, state.layers, state.master)
        _, (out_layers, s_layers, m_layers) = jax.lax.scan(body, None, xs)
        return _join(out_layers, u_rest, updates), state_cls(s_layers, s_rest, m_layers)

    return optax.GradientTransformation(init, update)


class LayerwiseOptimizer(NamedTuple):
    """optax.chain(clip_by_global_norm(max_grad_norm), layerwise(inner, ...)) (`init` / `update` are the chain's,
    its state too) plus `update_and_apply`, the train step's in-place form of the same update (see `in_place`)."""

    init: Callable
    update: Callable
    update_and_apply: Callable


def clipped_layerwise(inner: optax.GradientTransformation, *, offload: bool, master: bool = False,
                      max_grad_norm: float | None = None, fused=None) -> LayerwiseOptimizer:
    """The offload optimizer the trainer builds: clip by the global norm, then `layerwise(inner)`. `fused`: see
    `in_place`."""
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    chain = optax.chain(*parts, layerwise(inner, offload=offload, master=master))
    return LayerwiseOptimizer(chain.init, chain.update,
                              in_place(inner, offload=offload, max_grad_norm=max_grad_norm, fused=fused))


def in_place(inner: optax.GradientTransformation, *, offload: bool, max_grad_norm: float | None, fused=None):
    """`update_and_apply(grad_sums, denom, opt_state, params) -> (new params, new opt_state, grad norm)`: the
    update of `clipped_layerwise` (gradients grad_sums / denom), applied to the params, one layer at a time.

    Same math, element for element, as `grads = grad_sums / denom; chain.update; apply_updates` (the train step
    without it), but nothing of the size of all layers is created beside the accumulated gradients: the division
    and the clip run on layer l's gradient slice inside the loop, and the loop writes layer l's new params, state
    and master into the arrays it carries (dynamic_update_slice: in place in the donated buffers, the host ones
    included). The whole-tree form materialises grads / denom, the clipped grads and the stacked updates (3 x fp32
    per layer parameter on the device) and builds the new state in a second host buffer.

    `fused` (surojax/train/optim_8bit_fused.FusedAdam8bit, for `inner` = adamw_8bit; state and params on the
    device, no master): when `fused.active()`, the layers are updated all at once by its one-pass kernel per
    parameter instead of this loop, and the other params by the same kernel as a stack of one (the same math)."""

    def update_and_apply(grad_sums, denom, opt_state, params):
        lw = opt_state[-1]
        scaled = lambda g: g.astype(jnp.float32) / denom  # noqa: E731 - a single micro-batch's grads may be bf16
        grad_norm = optax.tree.norm(jax.tree.map(scaled, grad_sums))

        def grad(g):  # clip_by_global_norm(g / denom), as optax computes it
            g = scaled(g)
            if not max_grad_norm:
                return g
            return jax.lax.select(grad_norm < max_grad_norm, g, (g / grad_norm.astype(g.dtype)) * max_grad_norm)

        g_layers, g_rest = _split(grad_sums)
        p_layers, p_rest = _split(params)
        if fused is not None and fused.active() and not offload and lw.master is None:
            def fused_update(g, p, s):
                return fused.update_layers(g, grad, denom, grad_norm, max_grad_norm, p, s)

            p_layers, s_layers = fused_update(g_layers, p_layers, lw.layers)
            # the other params (embedding, head, final norm) as a stack of one layer: the same kernel
            one, unone = (lambda t: jax.tree.map(lambda x: x[None], t)), (lambda t: jax.tree.map(lambda x: x[0], t))
            new_rest, s_rest = unone(fused_update(one(g_rest), one(p_rest), one(lw.rest)))
            return (_join(p_layers, new_rest, params), (*opt_state[:-1], type(lw)(s_layers, s_rest, None)),
                    grad_norm)
        u_rest, s_rest = inner.update(jax.tree.map(grad, g_rest), lw.rest, p_rest)
        new_rest = optax.apply_updates(p_rest, u_rest)
        n_layers = jax.tree.leaves(g_layers)[0].shape[0]

        def at(tree, l):  # layer l's slice of every [L, ...] leaf
            return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, l, 0, keepdims=False), tree)

        def put(tree, new, l):  # `new` written as layer l of every [L, ...] leaf (in place in the loop's carry)
            return jax.tree.map(lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v, l, 0), tree, new)

        def body(l, carry):
            p, s, m = carry
            s_l, m_l = _fetch(at(s, l), None if m is None else at(m, l), offload=offload)
            # the slices read (copied out, to the device) before anything is written back: else XLA may fuse a read
            # of the old slice into a kernel it schedules after the in-place write, and copy the whole carried
            # array first. (After the fetch: a host slice must go straight to its copy to the device.)
            p_l, s_l, m_l = jax.lax.optimization_barrier((at(p, l), s_l, m_l))
            g_l = jax.tree.map(grad, at(g_layers, l))
            out_l, s_l, m_l = _layer_update(inner, g_l, p_l, s_l, m_l)
            if m is None:  # out_l is the update: materialised (as the stacked updates were) before it is added
                out_l = optax.apply_updates(p_l, jax.lax.optimization_barrier(out_l))
            s_l, m_l = _send(s_l, m_l, offload=offload)
            return put(p, out_l, l), put(s, s_l, l), None if m is None else put(m, m_l, l)

        p_layers, s_layers, m_layers = jax.lax.fori_loop(0, n_layers, body, (p_layers, lw.layers, lw.master))
        new_lw = type(lw)(s_layers, s_rest, m_layers)
        return _join(p_layers, new_rest, params), (*opt_state[:-1], new_lw), grad_norm

    return update_and_apply


def apply_master_updates(params, updates):
    """optax.apply_updates for a `layerwise(..., master=True)` optimizer: its `layers` updates are the new compute
    copies of the layers (taken as they are), the rest are deltas."""
    p_layers, p_rest = _split(params)
    u_layers, u_rest = _split(updates)
    new_layers = jax.tree.map(lambda p, u: u.astype(p.dtype), p_layers, u_layers)
    return _join(new_layers, optax.apply_updates(p_rest, u_rest), params)


def _master_state(opt_state):
    is_lw = lambda x: isinstance(x, (LayerwiseState, HostLayerwiseState))  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_lw) if is_lw(x) and x.master is not None]
    return found[0] if found else None


def _on_device(x):
    """`x` itself, or its device copy when it is in host memory."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return jax.device_put(x, x.sharding.with_memory_kind("device")) if kind == HOST_KIND else x


def compute_copy(trainable, dtype):
    """The trainable params with the stacked layers cast to the compute `dtype` on the device (the device copy that
    offload_master trains), leaf by leaf (a host-resident fp32 leaf is fetched, cast, and its device copy dropped
    before the next); device fp32 arrays are freed once nothing else refers to them (update the model too)."""
    layers, rest = _split(trainable)
    cast = jax.jit(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x)
    return _join(jax.tree.map(lambda x: cast(_on_device(x)), layers), rest, trainable)


def master_params(trainable, opt_state):
    """The trainable params with the layers' fp32 master weights (fetched from host) in place of their compute
    copy; `trainable` itself when the optimizer keeps no master (what to export / evaluate at full precision)."""
    st = _master_state(opt_state)
    if st is None:
        return trainable
    _, rest = _split(trainable)
    return _join(_to(jax.memory.Space.Device, st.master), rest, trainable)


def has_layerwise_state(state) -> bool:
    return any(isinstance(x, (LayerwiseState, HostLayerwiseState))
               for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, (LayerwiseState, HostLayerwiseState))))


def host_state_shardings(shardings):
    """The optimizer state's sharding tree with the `layers` part of every HostLayerwiseState and the `master`
    part of every layerwise state in pinned host memory (all of it: every leaf is stacked per layer and fetched
    by the per-layer update)."""
    host = lambda t: jax.tree.map(lambda s: s.with_memory_kind(HOST_KIND), t)  # noqa: E731

    def fix(node):
        if isinstance(node, (LayerwiseState, HostLayerwiseState)):
            layers = host(node.layers) if isinstance(node, HostLayerwiseState) else node.layers
            return type(node)(layers, node.rest, host(node.master))
        return node

    return jax.tree.map(fix, shardings, is_leaf=lambda x: isinstance(x, (LayerwiseState, HostLayerwiseState)))


def init_state_on_host(optimizer: optax.GradientTransformation, trainable, shardings):
    """The optimizer state with every (Host)LayerwiseState's per-layer part built on the host and placed by
    `shardings` (pinned memory for HostLayerwiseState), so the device never computes the whole [L, ...] state.

    The optimizer is initialised (jit, on the device) for a ONE-layer slice of the params; each per-layer leaf
    of that state ([1, ...]) is repeated L times on the host (every layer starts from the same state) and put
    with its host sharding; every other leaf is placed as `shardings` says. A `master` (offload_master) is the
    layers of `trainable` themselves, copied leaf by leaf to host memory (kept as they are when already there,
    offload.master.place_master_on_host): they must be the fp32 values."""
    layers, rest = _split(trainable)
    one_layer = jax.tree.map(lambda x: _on_device(x)[:1], layers)  # offload_master: layers may be on host
    small = jax.jit(optimizer.init)(_join(one_layer, rest, trainable))
    abstract = jax.eval_shape(optimizer.init, trainable)
    is_lw = lambda x: isinstance(x, (LayerwiseState, HostLayerwiseState))  # noqa: E731

    def put_master(v, sv):
        if v.dtype != jnp.float32:
            raise ValueError(f"offload_master: the layers' master weights must be fp32 (got {v.dtype}); initialise "
                             "the optimizer on the fp32 params, then make the compute copy (compute_copy)")
        return jax.device_put(v, v.sharding.with_memory_kind(sv.memory_kind) if hasattr(v, "sharding") else sv)

    def place(x, a, s):
        if is_lw(x):
            per_layer = jax.tree.map(
                lambda v, av, sv: jax.device_put(np.broadcast_to(np.asarray(v), av.shape), sv),
                x.layers, a.layers, s.layers)
            m = None if x.master is None else jax.tree.map(put_master, layers, s.master)
            return type(x)(per_layer, jax.device_put(x.rest, s.rest), m)
        return jax.device_put(x, s)

    return jax.tree.map(place, small, abstract, shardings, is_leaf=is_lw)
