"""The layer runner: how the decoder runs its layer stack.

`Decoder.hidden_states` embeds, asks its runner to run the layers, and final-norms. The runner is a static
attribute of the decoder (part of its graphdef: a frozen, hashable value) chosen from outside: `LayerScan` (the
default), `CarriedCacheScan`, or a loop of its own that implements the same `LayerRunner.run`
(offload/prefetch.py `PrefetchedLayers`: the streamed base fetched one layer ahead; parallel/pipeline.py
`PipelinedLayers`: the stages' microbatch schedule). The training run sets it through the layer-loop transform
(offload/layer_loop.py); serving passes one per call (`hidden_states(runner=...)`).

Layer pattern. What runs is a `LayerPattern`: a repeating pattern of layer types, each type naming the stack of
stacked parameters it reads and its static options (keyword arguments of the layer's call), e.g.

    [linear_attention x 3, full_attention x 1] x 6       Qwen3.5: stacks "linear_layers" [18, ...], "layers" [6, ...]
    [sliding x 5, global x 1] x 4 + [sliding x 2]         Gemma 3's 26 layers: one stack read by both types
    [sliding(window 128), full] x 12                      gpt_oss: two types, one stack `layers` [24, ...]

Layer i of the model has type `types[i % P]` (P = len(types)); a stack holds the layers of its types in layer
order, so a stack named by k of the P types is read as [G, k, ...] (G = L // P groups) plus the remainder's rows.
The scan runs over the G groups; its body applies the group's P layers in order (each wrapped by the recompute
policy); the L % P remainder layers (the pattern's first types) run after it. A pattern of one type over one
stack (`LayerPattern.uniform`, every dense and MoE family) is today's plain scan over [L, ...], unchanged: the
parameter paths (`layers/...`), checkpoints, LoRA targets and KV caches see one stack.

The layer call. A layer is an nnx module called as `layer(h, *consts, kv=, kv_meta=, **type.options) ->
(h, kv, router stats or None)`; `consts` are the call's per-row arrays (cos, sin, segment ids, positions), `kv`
that layer's view of its stack's cache (None without one: a KV view for attention layers, a recurrent-state view
for linear-attention layers) and `kv_meta` the call's metadata (`Cache.step`, shared by every layer).

Caches (models/kv/protocol.py). A model cache has one part per stack (`Cache.parts`: a one-stack model's cache is
its own part; a hybrid's holds the attention layers' KV cache and the linear layers' state cache), each over its
stack's rows ([rows, ...] leaves) and sliced exactly as that stack's parameters: scanned as the loop's input
(`per_layer()`, grouped [G, k, ...] + the remainder's rows) or carried whole in the loop's carry (`carried()`,
written in place; one row counter per stack, advanced only by that stack's layers). `with_layers` / `with_parts`
take the loop's result back. A cache part is named by the types that read it (`LayerType.cache_part`, by default
their stack; `LayerPattern.caches`): two stacks may share one part (lfm2_moe's dense leading conv layers in
`dense_conv_layers` and its sparse ones in `conv_layers`, one state part `conv_layers` over both, in layer order),
and the part is then sliced and counted over the layers that read it, not over one stack's rows.

Recompute (`recompute:` in the config, typed by `Recompute`): what a layer keeps for the backward pass; it wraps
each layer's body. Weight leaves in host memory are fetched per layer (`on_device`); leaves read in place
(`split_in_place`, quant/laid_out.py) are handed the whole stack and the layer's row.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable, Mapping
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

# Layer-type options the scan reads itself (not passed on as such): Gemma 4's KV sharing. A type with
# (KV_STORE, name) returns its keys / values (the layer is called with store_kv=True), a later type of the same
# group with (KV_FROM, name) is handed them (shared_kv=); both in one group of the pattern (its period).
KV_STORE, KV_FROM = "kv_store", "kv_from"
LAYER_INPUT = "layer_input"  # the checkpoint name of each layer's input (what `recompute: offload` moves to host)


class Recompute(enum.Enum):
    """Activation recomputation per layer (`recompute:`; `auto` is resolved by the run's memory plan before this):

        NONE     keep every activation of every layer (fastest, most memory)
        FULL     keep only each layer's input; recompute the layer in the backward pass
        DOTS     keep the outputs of matmuls without batch dimensions (projections), recompute the rest
        OFFLOAD  as FULL, but each layer's input (`LAYER_INPUT`) is kept in host memory (`pinned_host`) and copied
                 back for the backward pass: device memory for saved activations O(1) in depth

    With the base streamed from host memory the weights are never saved by FULL / DOTS / OFFLOAD (the layer is
    fetched again). On the CPU backend OFFLOAD runs the same program as FULL (the host copies are no-ops)."""

    NONE = "none"
    FULL = "full"
    DOTS = "dots"
    OFFLOAD = "offload"

    @classmethod
    def parse(cls, value: str) -> "Recompute":
        """The config's (or a CLI flag's) string -> the policy; `auto` is not a policy (resolve it first)."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"recompute {value!r} is unknown ({', '.join(r.value for r in cls)})") from None

    def wrap(self, body: Callable) -> Callable:
        """`body` under this policy's `jax.checkpoint` (NONE: `body` itself)."""
        if self is Recompute.NONE:
            return body
        if self is Recompute.FULL:
            policy = jax.checkpoint_policies.nothing_saveable
        elif self is Recompute.DOTS:
            policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        else:
            policy = jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
                offload_src="device", offload_dst="pinned_host")
        return jax.checkpoint(body, policy=policy)


# ---- the pattern ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerType:
    """One type of layer: the stack of stacked parameters it reads, its static call options (keyword
    arguments of the layer's call, e.g. `(("window", 128),)`) and the cache part it reads (`cache`; None: the part
    named as its stack). Two stacks may share one cache part (lfm2_moe's dense leading layers: stacks
    `dense_conv_layers` / `conv_layers` of one kind of mixer, one state part `conv_layers`): the part holds the rows
    of every layer that reads it, in layer order."""

    stack: str = "layers"
    options: tuple[tuple[str, Hashable], ...] = ()
    cache: str | None = None

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def cache_part(self) -> str:
        """The cache part this type reads (its stack's name unless `cache` says otherwise)."""
        return self.stack if self.cache is None else self.cache


@dataclasses.dataclass(frozen=True)
class LayerPattern:
    """`num_layers` layers, layer i of type `types[i % len(types)]` (module docstring)."""

    types: tuple[LayerType, ...]
    num_layers: int

    def __post_init__(self):
        if not self.types or self.num_layers < 1:
            raise ValueError(f"a layer pattern needs at least one type and one layer (got {len(self.types)} "
                             f"types, {self.num_layers} layers)")

    @classmethod
    def uniform(cls, num_layers: int, stack: str = "layers") -> "LayerPattern":
        """Every layer of one type over one stack: the plain scan over [L, ...]."""
        return cls((LayerType(stack),), num_layers)

    @property
    def period(self) -> int:
        return len(self.types)

    @property
    def groups(self) -> int:
        return self.num_layers // self.period

    @property
    def remainder(self) -> int:
        return self.num_layers % self.period

    @property
    def stacks(self) -> tuple[str, ...]:
        """The stacks the types read, in order of first use."""
        return tuple(dict.fromkeys(t.stack for t in self.types))

    def slot(self, position: int) -> int:
        """Where the type at `position` of the pattern reads its stack within a group: how many earlier
        positions name the same stack."""
        stack = self.types[position].stack
        return sum(t.stack == stack for t in self.types[:position])

    def per_group(self, stack: str) -> int:
        return sum(t.stack == stack for t in self.types)

    def rows(self, stack: str) -> int:
        """The layers `stack` holds."""
        return self.groups * self.per_group(stack) + sum(t.stack == stack for t in self.types[:self.remainder])

    @property
    def caches(self) -> tuple[str, ...]:
        """The cache parts the types read, in order of first use (`LayerType.cache_part`)."""
        return tuple(dict.fromkeys(t.cache_part for t in self.types))

    def cache_slot(self, position: int) -> int:
        """`slot` for the cache part: how many earlier positions read the same part."""
        part = self.types[position].cache_part
        return sum(t.cache_part == part for t in self.types[:position])

    def cache_per_group(self, part: str) -> int:
        return sum(t.cache_part == part for t in self.types)

    def cache_rows(self, part: str) -> int:
        """The layers whose cache rows cache part `part` holds."""
        return self.groups * self.cache_per_group(part) + sum(t.cache_part == part
                                                              for t in self.types[:self.remainder])

    def layer(self, i: int) -> tuple[LayerType, int]:
        """Layer i's type and its row in the type's stack."""
        p = i % self.period
        return self.types[p], (i // self.period) * self.per_group(self.types[p].stack) + self.slot(p)


class HiddenStates(NamedTuple):
    """What `Decoder.hidden_states` (and a runner) returns: the hidden states [B, T, D] (final-normed by the
    decoder), the updated cache (None without one) and the router statistics of the layers that produce them,
    stacked in layer order (None when no layer does, or the runner does not collect them)."""

    hidden: jax.Array
    cache: Any = None
    router_stats: Any = None


class LayerRunner(Protocol):
    """Runs the layer pattern. Implementations are frozen and hashable (part of the decoder's graphdef)."""

    def run(self, pattern: LayerPattern, stacks: Mapping[str, nnx.Module], h: jax.Array, consts: tuple, *,
            cache=None, kv_meta=None) -> HiddenStates:
        """h [B, T, D] after every layer (not final-normed). stacks: each stack's stacked module (leaves
        [rows, ...]); consts: the per-row arrays every layer reads; cache / kv_meta: the model cache (after its
        `step`; `cache.parts(pattern.stacks)` gives each stack's part) and the call's metadata, or None.
        `LayerScan.run` also takes `after_layer` (Qwen3-VL's deepstack); other runners need not."""
        ...


# ---- weights: host fetch, in-place leaves, stack checks ---------------------------------------------------------
def on_device(layer_state):
    """Copy the leaves of one layer's weights that live in host memory to the device (others pass through).

    The runner calls it on each layer's slice, so weights kept in host memory (offload_base_weights places the
    stacked base there) cross to the device one layer at a time, in the forward pass and again wherever the
    backward pass recomputes the layer; XLA schedules the copy. The embedding gather calls it on the table.
    """
    def fetch(x):
        if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
            return jax.device_put(x, jax.memory.Space.Device)
        return x

    return jax.tree.map(fetch, layer_state)


def check_stacked(layer_state, rows: int | None = None, stack: str = "layers") -> None:
    """The scan slices every leaf of a stack on its leading axis: every leaf must be [rows, ...]. A state that is
    not (a base held as per-layer host buffers, offload_prefetch's `HostLayers`: L arrays without the layers axis)
    needs a runner of its own (`PrefetchedLayers`)."""
    leading = {tuple(jnp.shape(x))[:1] for x in jax.tree.leaves(layer_state)}
    if len(leading) > 1 or (rows is not None and leading and leading != {(rows,)}):
        raise ValueError(f"the weights of layer stack {stack!r} are not stacked on one leading layers axis of "
                         f"{rows} (leading sizes {sorted(leading)}): the scan cannot run them. A base held as "
                         f"per-layer host buffers (offload_prefetch) is read by its own runner only "
                         f"(PrefetchedLayers, no KV cache)")


def split_in_place(layer_state):
    """The leaves of a layer stack that read their own layer in place (`stacked_in_place`: a weight laid out for
    the decode kernel, surojax.quant.laid_out) are not sliced by the scan: XLA would copy each layer's slice out
    of the stack before the kernel's custom call (a weight-sized copy per layer and token). -> (xs, rebuild):
    xs = layer_state with those leaves removed (None), for the scan to slice; rebuild(xs_l, i) = layer i's state,
    those leaves given the whole stack and the row i. (layer_state, None) when there are none."""
    in_place = lambda x: getattr(x, "stacked_in_place", False)  # noqa: E731
    leaves, treedef = jax.tree.flatten(layer_state, is_leaf=in_place)
    whole = {i: leaf for i, leaf in enumerate(leaves) if in_place(leaf)}
    if not whole:
        return layer_state, None
    xs = [None if i in whole else leaf for i, leaf in enumerate(leaves)]

    def rebuild(xs_l, index):
        return treedef.unflatten([whole[i].at_layer(index) if i in whole else leaf for i, leaf in enumerate(xs_l)])

    return xs, rebuild


def uniform_stack(pattern: LayerPattern, stacks: Mapping[str, nnx.Module], runner: str) -> nnx.Module:
    """The one stack of a one-type pattern (what a runner of its own reads); other patterns are refused."""
    if pattern.period != 1 or pattern.types[0].options:
        raise ValueError(f"{runner} runs a one-type layer stack without per-type options; this model's layer "
                         f"pattern has {pattern.period} types ({', '.join(t.stack for t in pattern.types)}, options "
                         f"{[t.options for t in pattern.types]}): use the layer scan")
    return stacks[pattern.types[0].stack]


# ---- the scan ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Stack:
    """One stack split for the scan: graphdef, the group rows [G, k, ...] (k = 1: [G, ...]), the remainder rows,
    and the in-place rebuild (None: none)."""
    graphdef: Any
    groups: Any
    rest: Any
    rebuild: Callable | None
    per_group: int


def _grouped(x, groups: int, k: int, whole: bool):
    """The group rows of a stacked leaf: [G, ...] as it is when k = 1 and it has no remainder rows (no slice, no
    reshape: the plain scan), else its first G k rows as [G, k, ...]."""
    if whole:
        return x
    x = jax.lax.slice_in_dim(x, 0, groups * k)
    return x.reshape(groups, k, *x.shape[1:]) if k > 1 else x


def _rows(tree, pattern: LayerPattern, name: str, *, cache: bool = False):
    """A tree stacked over stack `name`'s rows [rows, ...] (`cache`: cache part `name`'s) -> (group rows [G, k, ...]
    ([G, ...] for k = 1), remainder rows or None). A stack read once per group with no remainder rows is passed as
    it is (no slice, no reshape: the plain scan). Parameters and cache parts are split alike."""
    G = pattern.groups
    rows, k = ((pattern.cache_rows(name), pattern.cache_per_group(name)) if cache
               else (pattern.rows(name), pattern.per_group(name)))
    whole = k == 1 and rows == G
    groups = jax.tree.map(lambda x: _grouped(x, G, k, whole), tree)
    rest = None if whole else jax.tree.map(lambda x: jax.lax.slice_in_dim(x, G * k, rows), tree)
    return groups, rest


def _check_part(view, pattern: LayerPattern, name: str):
    """`view` (a cache part's per-layer or carried view), its array leaves checked to hold the part's rows (a view
    whose rows are not its leaves' (`num_rows`: the paged pool's KV-shared rows read another row) says so)."""
    rows = pattern.cache_rows(name)
    num_rows = getattr(view, "num_rows", None)
    leading = {num_rows} if num_rows is not None else {x.shape[0] for x in jax.tree.leaves(view) if jnp.ndim(x)}
    if leading != {rows}:
        raise ValueError(f"the cache of layer stack {name!r} holds {sorted(leading)} layers; the layer pattern "
                         f"gives that stack {rows}")
    return view


def _split(pattern: LayerPattern, stacks: Mapping[str, nnx.Module]) -> dict[str, _Stack]:
    out = {}
    for name in pattern.stacks:
        if name not in stacks:
            raise ValueError(f"the layer pattern reads stack {name!r}; the model has {sorted(stacks)}")
        graphdef, state = nnx.split(stacks[name])
        xs, rebuild = split_in_place(state)
        check_stacked(xs, pattern.rows(name), name)
        groups, rest = _rows(xs, pattern, name)
        out[name] = _Stack(graphdef, groups, rest, rebuild, pattern.per_group(name))
    return out


def _take(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _stack(trees: list):
    """Trees of one structure stacked leaf by leaf on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _stack_stats(stats: list):
    """The router stats of some layers stacked on a new leading axis, skipping the layers without (None when no
    layer has any)."""
    stats = [s for s in stats if s is not None]
    return _stack(stats) if stats else None


def _concat(a, b):
    """Two stacked trees one after the other on the leading axis (either may be None)."""
    if a is None or b is None:
        return b if a is None else a
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y]), a, b)


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """The layers under `jax.lax.scan` over the pattern's groups (one layer per group for a one-type pattern).

    recompute: the policy wrapping each layer's body. unroll: `lax.scan`'s (1: a rolled loop, one compiled group;
    True: every group inlined: no per-layer copies of the saved activations into stacked buffers, longer compile).
    carry_cache: each stack's whole cache rides in the scan carry and each layer writes its part in place
    (`part.carried()`) instead of being a scan input + output (`part.per_layer()`: a copy of every layer's slice
    in and out per call); same values. A part with `carry_only` (the paged serving pool) always rides in the
    carry."""

    recompute: Recompute = Recompute.NONE
    unroll: int | bool = 1
    carry_cache: bool = False

    def run(self, pattern: LayerPattern, stacks: Mapping[str, nnx.Module], h, consts: tuple, *, cache=None,
            kv_meta=None, after_layer: Callable | None = None, per_layer=None) -> HiddenStates:
        """As `LayerRunner.run`; `after_layer(i, h) -> h`, when given, runs after every layer with its (traced)
        HF layer index i, outside the recompute wrapper (Qwen3-VL's deepstack adds image features to the first
        layers' outputs: a `lax.cond` on i, so nothing [L, B, T, D] is made). `per_layer` [L, ...]: one input per
        HF layer, handed to layer i as `per_layer_input=per_layer[i]` (Gemma 4's per-layer input embeddings).
        Types with KV_STORE / KV_FROM options share keys / values within a group (module constants)."""
        split = _split(pattern, stacks)
        G, P, R = pattern.groups, pattern.period, pattern.remainder
        parts = {} if cache is None else dict(cache.parts(pattern.caches))  # cache part -> its cache
        carried = {n for n, part in parts.items() if self.carry_cache or part.carry_only}
        carries = {n: _check_part(parts[n].carried(), pattern, n) for n in carried}
        sliced = {n: _rows(_check_part(part.per_layer(), pattern, n), pattern, n, cache=True)
                  for n, part in parts.items() if n not in carried}
        layers = [self._layer(split[t.stack], t, consts, kv_meta) for t in pattern.types]

        def apply(positions, h, carries, states, rows, views, first=None, inputs=None):
            """The layers at `positions` of the pattern, in order, each with its parameters, row and cache view
            (its stack's carried cache instead when that rides in the carry: advanced a row after the layer) ->
            (h, carried caches, new per-layer views (None where carried or no cache), stats). `first`: the HF
            layer index of positions[0] (traced; needed by `after_layer` only). `inputs`: each position's
            per-layer input (or None)."""
            carries, new_views, stats, shared = dict(carries), [], [], {}
            for k, (p, state_l, row, view) in enumerate(zip(positions, states, rows, views)):
                name = pattern.types[p].cache_part
                opts = pattern.types[p].kwargs
                extra = {} if inputs is None else {"per_layer_input": inputs[k]}
                if KV_FROM in opts:
                    if opts[KV_FROM] not in shared:
                        raise ValueError(f"layer type {pattern.types[p]} reads the keys / values of {opts[KV_FROM]!r}, "
                                         "which no earlier layer of its group stores")
                    extra["shared_kv"] = shared[opts[KV_FROM]]
                out = layers[p](h, state_l, row, carries.get(name, view), extra)
                h, view, st = out[:3]
                if KV_STORE in opts:
                    shared[opts[KV_STORE]] = out[3]
                if after_layer is not None:
                    h = after_layer(first + k, h)
                if name in carries:
                    carries[name] = dataclasses.replace(view, layer=view.layer + 1)
                new_views.append(None if name in carries else view)
                stats.append(st)
            return h, carries, new_views, stats

        def group_body(carry, xs):
            h, carries, g = carry
            group, cache_groups, inputs = xs
            states, rows, views = [], [], []
            for p, t in enumerate(pattern.types):
                s, j = split[t.stack], pattern.slot(p)
                one = s.per_group == 1
                states.append(group[t.stack] if one else _take(group[t.stack], j))
                rows.append(None if s.rebuild is None else g * s.per_group + j)
                c = t.cache_part
                views.append(None if c not in cache_groups else cache_groups[c]
                             if pattern.cache_per_group(c) == 1 else _take(cache_groups[c], pattern.cache_slot(p)))
            h, carries, new_views, stats = apply(range(P), h, carries, states, rows, views,
                                                 None if g is None else g * P, inputs)
            ys = {}
            for name in cache_groups:  # each part's new views, as its slices came: [k, ...] or one view
                mine = [v for v, t in zip(new_views, pattern.types) if t.cache_part == name]
                ys[name] = mine[0] if pattern.cache_per_group(name) == 1 else _stack(mine)
            return (h, carries, None if g is None else g + 1), (ys, stats[0] if P == 1 else _stack_stats(stats))

        any_in_place = any(s.rebuild is not None for s in split.values())
        # the group index rides in the carry (0, 1, ...) rather than as a scanned arange: XLA merges it with the
        # loop's own counter, where a scanned one is a slice (a device copy) in every iteration
        g0 = jnp.int32(0) if any_in_place or after_layer is not None else None
        xs = ({name: s.groups for name, s in split.items()},
              {name: groups for name, (groups, _) in sliced.items()},
              None if per_layer is None else per_layer[:G * P].reshape(G, P, *per_layer.shape[1:]))
        new_groups, stats = {}, None
        if G:
            (h, carries, _), (new_groups, stats) = jax.lax.scan(group_body, (h, carries, g0), xs, length=G,
                                                                 unroll=self.unroll)
            if P > 1:  # [G, n, ...] -> [G n, ...]: layer (row) order
                stats = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), stats)
            new_groups = {name: jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), v)
                          if pattern.cache_per_group(name) > 1 else v for name, v in new_groups.items()}
        new_views = dict(new_groups)
        if R:  # the remainder: the pattern's first R types, once, after the groups
            rest = [(split[t.stack], pattern.slot(p), t.cache_part, pattern.cache_slot(p))
                    for p, t in enumerate(pattern.types[:R])]
            h, carries, rest_views, rest_stats = apply(
                range(R), h, carries, [_take(s.rest, j) for s, j, _, _ in rest],
                [G * s.per_group + j for s, j, _, _ in rest],
                [_take(sliced[n][1], jc) if n in sliced else None for _, _, n, jc in rest], jnp.int32(G * P),
                None if per_layer is None else per_layer[G * P:])
            stats = _concat(stats, _stack_stats(rest_stats))
            for name in sliced:
                mine = [v for v, (_, _, n, _) in zip(rest_views, rest) if n == name]
                if mine:
                    new_views[name] = _concat(new_views.get(name), _stack(mine))
        if cache is None:
            return HiddenStates(h, None, stats)
        new_views.update(carries)
        return HiddenStates(h, cache.with_parts({name: parts[name].with_layers(new_views[name]) for name in parts}),
                            stats)

    def _layer(self, s: _Stack, t: LayerType, consts: tuple, kv_meta) -> Callable:
        """One layer of type `t` as f(h, state_l, row, kv) -> (h, kv, stats), under the recompute policy."""
        options = {k: v for k, v in t.options if k not in (KV_STORE, KV_FROM)}
        if KV_STORE in t.kwargs:
            options["store_kv"] = True

        def apply(h, state_l, row, kv, extra):
            h = checkpoint_name(h, LAYER_INPUT)  # the residual that `recompute: offload` keeps in host memory
            state_l = state_l if s.rebuild is None else s.rebuild(state_l, row)
            layer = nnx.merge(s.graphdef, on_device(state_l))
            return layer(h, *consts, kv=kv, kv_meta=kv_meta, **options, **extra)

        return self.recompute.wrap(apply)


def with_runner(model: nnx.Module, runner: LayerRunner) -> nnx.Module:
    """`model` (a decoder) with `runner` as its layer runner: set in place, returned for chaining (a graphdef split
    from it afterwards holds the runner)."""
    model.runner = runner
    return model


@dataclasses.dataclass(frozen=True)
class CarriedCacheScan(LayerScan):
    """`LayerScan` with the KV cache in the scan carry, written in place (the serving runner's `kv_in_place`)."""

    carry_cache: bool = True


__all__ = ["CarriedCacheScan", "HiddenStates", "LAYER_INPUT", "LayerPattern", "LayerRunner", "LayerScan",
           "LayerType", "KV_FROM", "KV_STORE", "Recompute", "check_stacked", "on_device", "split_in_place", "uniform_stack",
           "with_runner"]
