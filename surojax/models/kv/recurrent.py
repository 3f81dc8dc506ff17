"""The fixed-size per-sequence state cache of a hybrid's non-attention layers, and the hybrid cache of generation.

A Gated DeltaNet layer (Qwen3.5's `linear_layers`) carries, per sequence, a fixed-size state whatever the
sequence's length:

    conv       [B, K - 1, C]     the last K - 1 inputs of its depthwise causal conv1d (C channels, kernel K), in
                                 the cache's dtype
    recurrent  [B, H, Dk, Dv]    the gated delta rule's state (H value heads), fp32

A short-convolution layer (LFM2's `conv_layers`, layers/short_conv.py) carries the conv part only (its shape a
`ConvShape`: C = hidden size channels, K = conv_L_cache taps); its `recurrent` is None (no leaves) throughout.

`StateCache` holds them for every linear layer ([L, ...] leaves, L = the `linear_layers` stack's rows), zeros
at the start of a sequence (a fresh cache). Two layer views of it, same values (as dense.py's k/v views):
`LayerState` (one layer's [B, ...] slice, scanned as the layer loop's input and returned as its output) and
`StackedLayerState` (every layer's state in the loop's carry, read and written at row `layer`). A layer reads its
view whole (`read()`) and hands the new state back (`written(conv, recurrent)`): surojax/models/layers/
deltanet_cache.py is that contract.

A `StateCache` whose batch axis counts sequence slots instead of rows is the serving engine's state pool
(surojax/serve/state_slots.py): `rows(slots, fresh)` gathers a call's rows from it (zeros for a sequence that
starts in the call) and `with_rows(slots, rows)` writes them back after the call.

A `TokenStateCache` (a `StateCache` of R rows whose states are wanted after a token chosen after the call:
speculative verification keeps the state after the last accepted token) gives its layers `TokenStatesView`s, to
which they write the call's inputs to their states; `at_tokens(index)` then replays each row's state.

`HybridCache` is a hybrid model's cache: a `KVCache` (generation; the serving engine's `PagedKVCache`) over the
attention stack (`layers`) and a `StateCache` over the state stack (`linear_layers`, or LFM2's `conv_layers`). Its
`step` is the attention part's: the metadata (segment ids, positions, write slots) and the lengths are the
sequence's, shared by both stacks; the states need no bookkeeping (each layer advances its own over the call's
real tokens).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.api import recurrent_gated_delta_step
from surojax.models.kv.dense import KVCache
from surojax.models.kv.meta import KVMeta
from surojax.models.kv.paged import PagedKVCache

ATTENTION_STACK = "layers"  # the decoder's stack of attention layers (its KV cache)
LINEAR_STACK = "linear_layers"  # the decoder's stack of Gated DeltaNet layers (its state cache)
CONV_STACK = "conv_layers"  # the decoder's stack of short-convolution layers (LFM2; its conv-state cache)
STATE_STACKS = (LINEAR_STACK, CONV_STACK)  # the stacks whose layers keep a fixed-size state per sequence


def state_stack(stacks) -> str | None:
    """The stack among `stacks` (a layer pattern's) whose layers keep per-sequence states; None when none does.
    A model has at most one (a config with both kinds is refused when it is read)."""
    return next((s for s in STATE_STACKS if s in stacks), None)


@dataclasses.dataclass(frozen=True)
class StateShape:
    """A Gated DeltaNet layer's head layout, which fixes its state's size: `num_key_heads` q/k heads of
    `key_head_dim`, `num_value_heads` v heads of `value_head_dim` (a multiple of the key heads: q/k heads are
    repeated), a conv of `conv_kernel` taps over the `conv_dim` concatenated q | k | v channels. The model's
    `ModelConfig.linear_attention` (`LinearAttentionConfig`) has these same fields and serves wherever a
    `StateShape` is asked for."""

    num_key_heads: int
    key_head_dim: int
    num_value_heads: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self):
        if min(self.num_key_heads, self.key_head_dim, self.num_value_heads, self.value_head_dim) < 1 \
                or self.conv_kernel < 2:
            raise ValueError(f"a Gated DeltaNet state needs positive head counts / dims and a conv kernel >= 2 "
                             f"(got {self})")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear attention: value heads ({self.num_value_heads}) must be a multiple of key "
                             f"heads ({self.num_key_heads})")

    @property
    def conv_dim(self) -> int:  # C: q | k | v
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """A short-convolution layer's state layout (LFM2): a depthwise causal conv of `conv_kernel` taps over
    `conv_dim` channels; no recurrent state."""

    conv_dim: int
    conv_kernel: int

    def __post_init__(self):
        if self.conv_dim < 1 or self.conv_kernel < 2:
            raise ValueError(f"a short-convolution state needs channels >= 1 and a conv kernel >= 2 (got {self})")


def conv_state_shape(shape: StateShape | ConvShape, batch: int) -> tuple[int, int, int]:
    """[B, K - 1, C]: one layer's conv state."""
    return (batch, shape.conv_kernel - 1, shape.conv_dim)


def recurrent_state_shape(shape: StateShape, batch: int) -> tuple[int, int, int, int]:
    """[B, H, Dk, Dv]: one layer's recurrent state (H value heads)."""
    return (batch, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerState:
    """One layer's state slice: conv [B, K - 1, C], recurrent [B, H, Dk, Dv] fp32 (None: a short conv's)."""

    conv: jax.Array
    recurrent: jax.Array

    per_token: ClassVar[bool] = False  # the layer writes the state after its last real token

    def read(self) -> tuple[jax.Array, jax.Array]:
        return self.conv, self.recurrent

    def written(self, conv, recurrent) -> "LayerState":
        return LayerState(conv.astype(self.conv.dtype), _cast(recurrent, self.recurrent))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenStatesView:
    """One layer's state slice in a call whose states are kept for a later pick of each row's token
    (`TokenStateCache`): read as `LayerState` (conv [B, K - 1, C], recurrent [B, H, Dk, Dv]); ``written`` with the
    call's INPUTS to the state instead of a new state: the conv inputs [B, T, C] and the delta rule's `DeltaInputs`
    (None: a short conv's), from which `TokenStateCache.at_tokens` replays the state to any token. The state read
    stays as it was."""

    conv: jax.Array
    recurrent: jax.Array
    conv_in: jax.Array | None = None
    rule_in: "DeltaInputs | None" = None

    per_token: ClassVar[bool] = True

    def read(self) -> tuple[jax.Array, jax.Array]:
        return self.conv, self.recurrent

    def written(self, conv_in, rule_in) -> "TokenStatesView":
        return TokenStatesView(self.conv, self.recurrent, conv_in, rule_in)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaInputs:
    """What the gated delta rule's state takes from each token of a call: k [B, T, H, Dk] (L2-normalised, repeated to
    the value heads), v [B, T, H, Dv], g and beta [B, T, H] fp32 (0 on padding: the state passes unchanged)."""

    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def _cast(new, old):
    """`new` in `old`'s dtype (None stays None: a conv-only state has no recurrent part)."""
    return None if old is None else new.astype(old.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayerState:
    """Every layer's state, conv [L, B, K - 1, C] and recurrent [L, B, H, Dk, Dv], and the row [] int32 of the
    layer this view serves."""

    conv: jax.Array
    recurrent: jax.Array
    layer: jax.Array

    per_token: ClassVar[bool] = False

    def read(self) -> tuple[jax.Array, jax.Array | None]:
        return self.conv[self.layer], None if self.recurrent is None else self.recurrent[self.layer]

    def written(self, conv, recurrent) -> "StackedLayerState":
        l = self.layer
        new = None if self.recurrent is None else self.recurrent.at[l].set(recurrent.astype(self.recurrent.dtype))
        return StackedLayerState(self.conv.at[l].set(conv.astype(self.conv.dtype)), new, l)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateCache:
    """The state layers' states: conv [L, B, K - 1, C] (the cache's dtype), recurrent [L, B, H, Dk, Dv] fp32 (None
    for short-convolution layers). The cache of one layer stack (`StackCache`); a model cache holds it as a part
    (`HybridCache`)."""

    conv: jax.Array
    recurrent: jax.Array

    carry_only: ClassVar[bool] = False

    @classmethod
    def empty(cls, num_layers: int, batch: int, shape: StateShape | ConvShape, dtype) -> "StateCache":
        """Zeros: the state before a sequence's first token (a `ConvShape`: the conv window only)."""
        recurrent = None if isinstance(shape, ConvShape) else jnp.zeros(
            (num_layers, *recurrent_state_shape(shape, batch)), jnp.float32)
        return cls(jnp.zeros((num_layers, *conv_state_shape(shape, batch)), dtype), recurrent)

    def carried(self) -> StackedLayerState:
        return StackedLayerState(self.conv, self.recurrent, jnp.int32(0))

    def per_layer(self) -> LayerState:
        return LayerState(self.conv, self.recurrent)

    def with_layers(self, view: LayerState | StackedLayerState) -> "StateCache":
        return StateCache(view.conv, view.recurrent)

    def rows(self, slots: jax.Array, fresh: jax.Array) -> "StateCache":
        """This cache as a pool of sequence slots [L, N, ...] -> the states of the slots [R] int32 as a cache of
        R rows [L, R, ...]: zeros where fresh [R] bool (a sequence that starts in this call) or the slot is out of
        range (>= N: a padding row)."""
        def take(pool):
            got = pool.at[:, slots].get(mode="fill", fill_value=0)
            keep = (~fresh).reshape(1, -1, *(1,) * (pool.ndim - 2))
            return jnp.where(keep, got, jnp.zeros((), pool.dtype))

        return jax.tree.map(take, self)

    def with_rows(self, slots: jax.Array, rows: "StateCache") -> "StateCache":
        """This pool with the rows' states [L, R, ...] written back at their slots [R] (a slot >= N is dropped:
        padding rows). The slots of real rows are distinct."""
        return jax.tree.map(lambda pool, new: pool.at[:, slots].set(new.astype(pool.dtype), mode="drop"), self, rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenStateCache(StateCache):
    """A `StateCache` of R rows [L, R, ...] for a call whose rows keep the state after a token chosen only after
    the call (speculative verification: the last ACCEPTED one, known from the call's logits). Its layers get
    `TokenStatesView`s (scanned per layer, never carried) and hand back, beside the states they read, the call's
    inputs to them ([L, R, T, ...]: conv_in, rule_in); `at_tokens(index)` replays each row's state from the states
    read to its token index[r] (a plain `StateCache`). Keeping inputs, not T states, costs ~1/40 of the memory
    (Qwen3.5: per head Dk + Dv + 2 values a token instead of Dk x Dv)."""

    conv_in: jax.Array | None = None
    rule_in: DeltaInputs | None = None

    def carried(self):
        raise TypeError("TokenStateCache is scanned per layer (its layers hand back their inputs), never carried")

    def per_layer(self) -> TokenStatesView:
        return TokenStatesView(self.conv, self.recurrent)

    def with_layers(self, view: TokenStatesView) -> "TokenStateCache":
        return TokenStateCache(view.conv, view.recurrent, view.conv_in, view.rule_in)

    def at_tokens(self, index: jax.Array) -> StateCache:
        """index [R] int32 (< T) -> each row's state after its token index[r]: a `StateCache` [L, R, ...]. The conv
        window: the last K - 1 inputs of [conv; conv_in[:index + 1]]; the recurrent state: the decode step's
        one-token rule (`recurrent_gated_delta_step`) over tokens 0 .. index[r] (g = beta = 0 past it)."""
        L, R, Km1 = self.conv.shape[:3]
        xin = jnp.concatenate([self.conv, self.conv_in.astype(self.conv.dtype)], axis=2)  # [L, R, K - 1 + T, C]
        idx = (index[:, None] + 1 + jnp.arange(Km1))[None, :, :, None]  # [1, R, K - 1, 1]
        conv = jnp.take_along_axis(xin, idx, axis=2)
        if self.recurrent is None:
            return StateCache(conv, None)
        r = self.rule_in
        T = r.k.shape[2]
        keep = (jnp.arange(T)[None, :] <= index[:, None])[None, :, :, None]  # [1, R, T, 1]
        flat = lambda x: jnp.moveaxis(x, 2, 0).reshape(T, L * R, *x.shape[3:])  # noqa: E731 [T, L R, ...]
        xs = (flat(r.k), flat(r.v), flat(jnp.where(keep, r.g, 0.0)), flat(jnp.where(keep, r.beta, 0.0)))

        def step(state, x):
            k, v, g, beta = x
            return recurrent_gated_delta_step(k, k, v, g, beta, state, scale=1.0)[1], None  # the state alone

        state, _ = jax.lax.scan(step, self.recurrent.reshape(L * R, *self.recurrent.shape[2:]), xs)
        return StateCache(conv, state.reshape(self.recurrent.shape).astype(self.recurrent.dtype))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kv", "state"],
                   meta_fields=["kv_stack", "state_stack"])
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """A hybrid model's cache: `kv` (a `KVCache` over the attention stack's rows, or serving's `PagedKVCache`) and
    `state` (a `StateCache` over the state stack's rows: `linear_layers`, or `conv_layers` with
    state_stack=CONV_STACK). One sequence per row; `step`, `lengths` and the metadata are the
    attention part's (module docstring)."""

    kv: KVCache | PagedKVCache
    state: StateCache
    kv_stack: str = ATTENTION_STACK
    state_stack: str = LINEAR_STACK

    @classmethod
    def empty(cls, kv: KVCache, num_state_layers: int, shape: StateShape | ConvShape, dtype,
              state_stack: str = LINEAR_STACK) -> "HybridCache":
        """`kv` (an empty KVCache over the attention layers) and zero states for the state stack's layers."""
        return cls(kv, StateCache.empty(num_state_layers, kv.lengths.shape[0], shape, dtype),
                   state_stack=state_stack)

    @property
    def lengths(self) -> jax.Array:
        """[B]: each row's tokens so far (the next decode position)."""
        return self.kv.lengths

    def step(self, segment_ids, positions) -> tuple[KVMeta, "HybridCache"]:
        meta, kv = self.kv.step(segment_ids, positions)
        return meta, dataclasses.replace(self, kv=kv)

    def parts(self, stacks: tuple[str, ...]) -> dict[str, KVCache | StateCache]:
        if sorted(stacks) != sorted((self.kv_stack, self.state_stack)):
            raise ValueError(f"this hybrid cache holds the stacks {self.kv_stack!r} (KV) and {self.state_stack!r} "
                             f"(per-sequence states); the layer pattern reads {list(stacks)}")
        return {self.kv_stack: self.kv, self.state_stack: self.state}

    def with_parts(self, parts: Mapping[str, KVCache | StateCache]) -> "HybridCache":
        return dataclasses.replace(self, kv=parts[self.kv_stack], state=parts[self.state_stack])


__all__ = ["ATTENTION_STACK", "CONV_STACK", "LINEAR_STACK", "STATE_STACKS", "ConvShape", "DeltaInputs", "HybridCache",
           "LayerState", "StackedLayerState", "StateCache", "StateShape", "TokenStateCache", "TokenStatesView",
           "conv_state_shape", "recurrent_state_shape", "state_stack"]
