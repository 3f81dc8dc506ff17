"""`offload_prefetch`: the streamed layer loop, double-buffered, so the copy of layer l+1 overlaps layer l's compute.

The plain streamed loop (streaming.py) fetches layer l inside scan step l, right before its matmuls: the copy and
the compute it feeds are serial, and XLA does not move the copy into the previous step (step time ~ compute +
copies: benchmarks/RESULTS.md). Here the copy is issued one step early, explicitly:

    forward   w = fetch(host[0])
              scan l = 0..L-1, carry (h, w):   w' = fetch(host[min(l+1, L-1)])     (independent of h)
                                               h  = layer(lora[l], w, h);  save h_in[l]
              carry (h, w')
    backward  w = fetch(host[L-1])
              scan l = L-1..0, carry (dh, w):  w' = fetch(host[max(l-1, 0)])     (independent of dh)
                                               dlora[l], dh = vjp(layer(., w, .), lora[l], h_in[l])(dh)
              carry (dh, w')

Within a step the fetch of the next layer shares no data with the layer's compute, so XLA may run the
host-to-device copy (copy-start / copy-done) alongside it; two layers' weights are on the device at a time. The
last step of each scan re-fetches the layer it already holds (one extra copy out of L, ~3% of the traffic for 32
layers) rather than compiling the layer twice.

The pair is a `jax.custom_vjp` over the whole layer stack: autodiff of a scan whose carry holds the device copy
would save every layer's copy for the backward pass (the whole base on the device); the custom rule saves only
each layer's input h_in [L, B, T, D] (what `recompute: full` saves) and recomputes the layer from it, so the
numerics are those of `recompute: full` (equal bit for bit on CPU: tests/offload/test_prefetch.py). Only the
inexact leaves that are not in host memory (the LoRA adapters) get cotangents; host leaves (the base) and integer
leaves (LoRA dropout keys) get none.

Two forms. Over a stacked host base ([L, ...] pinned arrays) the loops above are scans; on the GPU XLA copies a
slice of a stacked host array with a kernel on the compute stream, so those copies run serially with the compute
(benchmarks/RESULTS.md, "Host streaming"). Over per-layer host buffers (`host_layers.HostLayers`, what
`offload_prefetch` places) the same schedule runs as an unrolled Python loop (`_unrolled_stack`) whose fetches
are whole-buffer copies, which XLA issues as asynchronous DMA beside the compute. In that loop nothing but data
dependencies orders a copy, and XLA's scheduler starts each as early as its operands allow: an independent fetch
of every layer would be issued at once and hold the whole base on the device. So each fetch is made to depend,
through an optimization barrier, on the output of the layer `PREFETCH_DEPTH + 1` places before it (forward) or
after it (backward): at most 1 + depth layers' device copies are live, which is what memory_plan.py counts.

A pattern of several layer types (Qwen3.5's hybrid: `linear_layers` x 3 then `layers`, per group) runs as that
unrolled loop over the layers in model order (`prefetched_pattern`): each layer's fetch takes its row of its own
stack, so the look-ahead crosses from one stack to the other as the layers do.

Used as the decoder's layer runner (surojax/models/layer_runner.py): the layer-loop transform sets
`PrefetchedLayers()` for `offload_prefetch: true`. It collects no MoE router statistics (`router_stats` None).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layer_runner import HiddenStates, LayerPattern, uniform_stack
from surojax.offload.host_layers import is_host_layers

FETCH_TO = jax.memory.Space.Device
PREFETCH_DEPTH = 1  # layers fetched beyond the one computing (the unrolled loop's bound; memory_plan models it)


def is_host(x) -> bool:
    if is_host_layers(x):
        x = x.layers[0]
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def _fetch(host_leaves: tuple, index) -> tuple:
    """Layer `index` of each stacked host leaf, copied to device memory."""
    return tuple(jax.device_put(jax.lax.dynamic_index_in_dim(x, index, keepdims=False), FETCH_TO)
                 for x in host_leaves)


@dataclasses.dataclass(frozen=True)
class _Split:
    """Where each leaf of the layer state goes: (kind, position) with kind 'diff' | 'dev' | 'host'."""
    treedef: object
    slots: tuple

    @classmethod
    def of(cls, layer_state):
        leaves, treedef = jax.tree.flatten(layer_state, is_leaf=is_host_layers)
        counts = {"diff": 0, "dev": 0, "host": 0}
        slots = []
        for x in leaves:
            kind = "host" if is_host(x) else "diff" if jnp.issubdtype(x.dtype, jnp.inexact) else "dev"
            slots.append((kind, counts[kind]))
            counts[kind] += 1
        return cls(treedef, tuple(slots)), leaves

    def parts(self, leaves):
        out = {"diff": [], "dev": [], "host": []}
        for (kind, _), x in zip(self.slots, leaves):
            out[kind].append(x)
        return tuple(out["diff"]), tuple(out["dev"]), tuple(out["host"])

    def join(self, diff, dev, host):
        parts = {"diff": diff, "dev": dev, "host": host}
        return jax.tree.unflatten(self.treedef, [parts[kind][i] for kind, i in self.slots])


def _index(leaves: tuple, l) -> tuple:
    return tuple(jax.lax.dynamic_index_in_dim(x, l, keepdims=False) for x in leaves)


def prefetched_layer_stack(apply_layer: Callable, h: jax.Array, layer_state, consts, *, unroll: int | bool = 1,
                           per_layer: bool = False, depth: int = PREFETCH_DEPTH):
    """h after every layer of `layer_state` (stacked [L, ...]), each layer's host leaves fetched one step ahead.

    apply_layer(state_l, h, consts) -> h: one layer (state_l: the layer's slice of `layer_state`, every leaf on
    the device). consts: arrays every layer reads (not differentiated). The layers run as a Python loop
    (`_unrolled_stack`) when a host leaf is a `HostLayers` or with `per_layer` (the same program over a resident
    base: the exactness protocol's twin), else as scans. depth: layers fetched beyond the one computing in the
    unrolled loop (the scans hold one by construction: a fetch cannot leave its loop step).
    """
    split, leaves = _Split.of(layer_state)
    diff, dev, host = split.parts(leaves)
    num_layers = leaves[0].shape[0]

    def layer(diff_l, dev_l, host_l, h, consts):
        return apply_layer(split.join(diff_l, dev_l, host_l), h, consts)

    if per_layer or any(map(is_host_layers, host)):
        return _unrolled_stack(layer, diff, dev, host, h, consts, num_layers, depth)

    def forward(diff, dev, host, h, consts, save: bool):
        def step(carry, l):
            h, w = carry
            w_next = _fetch(host, jnp.minimum(l + 1, num_layers - 1))
            h_out = layer(_index(diff, l), _index(dev, l), w, h, consts)
            return (h_out, w_next), (h if save else None)

        (h, _), saved = jax.lax.scan(step, (h, _fetch(host, 0)), jnp.arange(num_layers), unroll=unroll)
        return h, saved

    def stack_bwd(res, dh):
        diff, dev, host, h_in, consts = res

        def step(carry, l):
            dh, w = carry
            w_prev = _fetch(host, jnp.maximum(l - 1, 0))
            dev_l = _index(dev, l)
            _, vjp = jax.vjp(lambda d, x: layer(d, dev_l, w, x, consts), _index(diff, l),
                             jax.lax.dynamic_index_in_dim(h_in, l, keepdims=False))
            d_diff, dh = vjp(dh)
            return (dh, w_prev), d_diff

        last = num_layers - 1
        (dh, _), d_diff = jax.lax.scan(step, (dh, _fetch(host, last)), jnp.arange(num_layers), reverse=True,
                                       unroll=unroll)
        return d_diff, None, None, dh, None

    return _layer_stack_vjp(forward, stack_bwd)(diff, dev, host, h, consts)


def _layer_stack_vjp(forward: Callable, backward: Callable):
    """The layer stack as a custom_vjp: forward(diff, dev, host, h, consts, save) -> (h, saved inputs); the
    residuals are the inputs and each layer's saved input (never a device copy of the weights); backward(res, dh)
    -> (d diff, None, None, dh, None)."""
    @jax.custom_vjp
    def stack(diff, dev, host, h, consts):
        return forward(diff, dev, host, h, consts, save=False)[0]

    def stack_fwd(diff, dev, host, h, consts):
        out, h_in = forward(diff, dev, host, h, consts, save=True)
        return out, (diff, dev, host, h_in, consts)

    stack.defvjp(stack_fwd, backward)
    return stack


def _fetch_static(host_leaves: tuple, l: int, after=None) -> tuple:
    """Layer l (a Python int) of each host leaf on the device: a whole per-layer buffer of a HostLayers (an
    asynchronous copy XLA overlaps with compute), else a static slice of a stacked host array.

    after: an array the copy must wait for. The sources pass through an optimization barrier together with it, so
    the copies read values that exist only once `after` is computed: XLA cannot start them earlier (the barrier
    moves no data; the values are unchanged)."""
    sources = tuple(x.layers[l] if is_host_layers(x) else x for x in host_leaves)
    if after is not None:
        sources, _ = jax.lax.optimization_barrier((sources, after))
    return tuple(jax.device_put(s if is_host_layers(x) else s[l], FETCH_TO) for s, x in zip(sources, host_leaves))


def _unrolled_stack(layer: Callable, diff: tuple, dev: tuple, host: tuple, h, consts, num_layers: int, depth: int):
    """One stack's layers 0 .. L-1 through `_unrolled_layers`."""
    order = tuple((None, l, layer) for l in range(num_layers))
    return _unrolled_layers(order, {None: diff}, {None: dev}, {None: host}, h, consts, depth)


def _unrolled_layers(order: tuple, diff: dict, dev: dict, host: dict, h, consts, depth: int):
    """The layers as a Python loop in `order`, with a bounded look-ahead: at most `depth` layers beyond the one
    computing are fetched or in flight.

    order: (stack, row, layer) per layer in model order, layer(diff_l, dev_l, host_l, h, consts) -> h; diff / dev /
    host: each stack's leaves by kind ([rows, ...] arrays, host leaves possibly `HostLayers`). One stack read in
    row order is the uniform model; a hybrid's pattern interleaves its stacks (Qwen3.5: `linear_layers` x 3, then
    `layers`), each layer fetching its row of its own stack.

        forward   fetch 0 .. depth (unordered);  for l = 0 .. L-1:  h = layer_l(h);  fetch l+1+depth after h
        backward  fetch L-1 .. L-1-depth after dh;  for l = L-1 .. 0:  dh = vjp(layer_l)(dh);  fetch l-1-depth after dh

    Each fetch depends only on host buffers and on the activation (cotangent) of a layer already done, so XLA may
    run it during the compute of the layers in between, and at most 1 + depth layers' device copies are live at any
    time (XLA's scheduler starts a copy as early as its operands allow: an unordered fetch of every layer would be
    issued up front and hold the whole base). Same math as the scan form (recompute full); the unrolled program may
    fuse and so round differently, hence its own resident twin (`PrefetchedLayers(per_layer=True)`)."""
    L = len(order)

    def at(leaves, row):
        return tuple(x[row] for x in leaves)

    def fetch(l, after=None):
        stack, row, _ = order[l]
        return _fetch_static(host[stack], row, after)

    def forward(diff, dev, host, h, consts, save: bool):
        saved = []
        fetched = {j: fetch(j) for j in range(min(depth + 1, L))}
        for l, (stack, row, layer) in enumerate(order):
            if save:
                saved.append(h)
            h = layer(at(diff[stack], row), at(dev[stack], row), fetched.pop(l), h, consts)
            if l + 1 + depth < L:
                fetched[l + 1 + depth] = fetch(l + 1 + depth, after=h)
        return h, tuple(saved)

    def stack_bwd(res, dh):
        diff, dev, host, h_in, consts = res
        grads = {stack: {} for stack in diff}
        # the first copies wait for the cotangent and the last layer's input: never alongside the forward pass
        first = range(L - 1, max(L - 2 - depth, -1), -1)
        fetched = {j: fetch(j, after=(dh, h_in[L - 1])) for j in first}
        for l in reversed(range(L)):
            stack, row, layer = order[l]
            dev_l, w = at(dev[stack], row), fetched.pop(l)
            # the recompute of layer l reads only h_in[l]: the barrier keeps it after layer l+1's gradient, so XLA
            # cannot hoist every recompute to the start of the backward pass
            x_l, dh = jax.lax.optimization_barrier((h_in[l], dh))
            _, vjp = jax.vjp(lambda d, x, w=w, dev_l=dev_l, layer=layer: layer(d, dev_l, w, x, consts),
                             at(diff[stack], row), x_l)
            grads[stack][row], dh = vjp(dh)
            if l - 1 - depth >= 0:
                fetched[l - 1 - depth] = fetch(l - 1 - depth, after=dh)
        d_diff = {stack: tuple(jnp.stack([grads[stack][r][i] for r in sorted(grads[stack])])
                               for i in range(len(leaves))) for stack, leaves in diff.items()}
        return d_diff, None, None, dh, None

    return _layer_stack_vjp(forward, stack_bwd)(diff, dev, host, h, consts)


@dataclasses.dataclass(frozen=True)
class PrefetchedLayers:
    """The decoder's layer runner for `offload_prefetch` (surojax.models.layer_runner.LayerRunner): the whole
    layer stack through `prefetched_layer_stack` (recompute full semantics, the next layer fetched early); a
    pattern of several layer types (a hybrid's two stacks) through `prefetched_pattern`, the unrolled loop in
    layer order. No KV cache, no router statistics.
    per_layer: always the unrolled per-layer loop (what a `HostLayers` base gets; for its resident twin).
    depth: layers fetched beyond the one computing in that loop (>= 1; each adds one layer of device memory).
    unroll: the scan form's `lax.scan` unroll."""

    per_layer: bool = False
    depth: int = PREFETCH_DEPTH
    unroll: int | bool = 1

    def __post_init__(self):
        if self.depth < 1:
            raise ValueError(f"prefetch depth must be >= 1 (got {self.depth})")

    def run(self, pattern: LayerPattern, stacks, h, consts: tuple, *, cache=None, kv_meta=None) -> HiddenStates:
        if cache is not None:
            raise ValueError("the prefetching layer runner (offload_prefetch) is for training: it takes no KV cache")
        if pattern.period > 1:  # several layer types (a hybrid's two stacks): the unrolled loop in layer order
            return HiddenStates(prefetched_pattern(pattern, stacks, h, consts, depth=self.depth))
        graphdef, layer_state = nnx.split(uniform_stack(pattern, stacks, "the prefetching layer runner"))
        options = pattern.types[0].kwargs

        def apply_layer(state_l, h, consts):
            return nnx.merge(graphdef, state_l)(h, *consts, **options)[0]

        h = prefetched_layer_stack(apply_layer, h, layer_state, consts, unroll=self.unroll, per_layer=self.per_layer,
                                   depth=self.depth)
        return HiddenStates(h)


def prefetched_pattern(pattern: LayerPattern, stacks, h: jax.Array, consts, *, depth: int = PREFETCH_DEPTH):
    """h after every layer of a pattern of several layer types (each type: its stack and static options), in model
    order, as the unrolled prefetching loop (`_unrolled_layers`): layer i fetches its row of its own stack one
    layer ahead, whatever stack the layer before it read. (No scan form: the scan over a pattern's groups would
    fetch a whole group at once.)"""
    diff, dev, host, layers = {}, {}, {}, {}
    for name in pattern.stacks:
        graphdef, state = nnx.split(stacks[name])
        split, leaves = _Split.of(state)
        diff[name], dev[name], host[name] = split.parts(leaves)
        layers[name] = graphdef, split

    def layer_of(t):
        graphdef, split = layers[t.stack]
        options = t.kwargs
        return lambda d, v, w, h, consts: nnx.merge(graphdef, split.join(d, v, w))(h, *consts, **options)[0]

    by_type = {t: layer_of(t) for t in pattern.types}
    order = tuple((t.stack, row, by_type[t]) for t, row in map(pattern.layer, range(pattern.num_layers)))
    return _unrolled_layers(order, diff, dev, host, h, consts, depth)
