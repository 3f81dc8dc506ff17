"""Per-sequence state slots: how the serving engine keeps a hybrid model's linear-attention / short-conv states.

A Gated DeltaNet layer (a hybrid's `linear_layers` stack: Qwen3.5) carries per sequence a fixed-size state
(models/kv/recurrent.py: conv [K - 1, C] in the activation dtype, recurrent [H, Dk, Dv] fp32) where an attention
layer keeps KV that grows with the sequence; an LFM2 short-convolution layer (`conv_layers`) its conv window
[K - 1, D] alone. Below, "linear layers" means either stack. The engine keeps the attention layers' KV in the
paged pool (blocks, the attention stack's layers only) and the linear layers' states in a pool of slots, one per
running sequence:

    pool        a `StateCache` [L_linear, N, ...] over N = max_num_seqs slots (`state_pool`), zeros at first,
                owned by the runner and donated to each call like the KV pools
    StateSlots  the host side: which slot each running sequence holds. The scheduler allocates one when it
                admits a request and frees it when the request finishes, is aborted or is preempted (a preempted
                request recomputes from its first token, from zeros again); `ScheduledRequest.state_slot`
                carries it to the runner, which sends the rows' slots as `InputBatch.state_slots` [R] (padding
                rows: N, out of range)
    one call    `with_state_rows` gathers the rows' states from the pool (`StateCache.rows`), zeros for a row
                whose sequence starts in this call (start == 0: a slot is zeroed with its new sequence, so a
                reused slot never leaks its last owner's state), and gives the decoder a `HybridCache` (the paged
                KV + those rows); `split_state_rows` writes the new states back at their slots
                (`StateCache.with_rows`). One gather and one scatter per call, at the call's bucketed shapes: the
                request mix never recompiles anything.

Inside the decoder each row continues its own state (layers/deltanet_cache.py `deltanet_mix`): a prefill chunk
(a prompt split over several steps by the token budget) runs the chunk rule from the row's state, a decode row the
one-token recurrent step, and right padding (a chunk shorter than the call's width, a stopped row of a multi-step
decode) leaves the state unchanged.

What a state cannot do: be rolled back (the state after token n does not give the state after token n - 1), nor
be rebuilt from a cached prefix's KV pages (they hold no state of the linear layers). So a hybrid model is
served without prefix caching (`PREFIX_CACHING_OFF`, logged once); LFM2's conv windows likewise (`*_CONV`).

Speculative decoding, whose verify step feeds [last, d_1 .. d_k] and keeps only [last, d_1 .. d_a]: the verify
call gathers the rows' states as a `TokenStateCache` (``with_state_rows(per_token=True)``): each state layer
computes its outputs with the decode step's one-token recurrence (k + 1 times) and hands back its inputs to the
state (the conv inputs; the delta rule's k, v, g, beta: [L, R, k + 1, ...], ~1/40 of k + 1 states), and
``split_state_rows(at_token=count - 1)`` replays each row's state from the one it had to its last accepted token
(`TokenStateCache.at_tokens`) and writes it back. A hybrid DRAFT model is refused (`SPECULATIVE_REFUSED`): its
proposal loop would need the same.
"""
from __future__ import annotations

import jax

from surojax.models.decoder import Decoder
from surojax.models.kv import CONV_STACK, Cache, HybridCache, StateCache, TokenStateCache

PREFIX_CACHING_OFF = ("prefix caching is off for hybrid models: a cached prefix's KV pages do not carry the "
                      "linear-attention layers' state at the block boundary")
SPECULATIVE_REFUSED = ("a hybrid model cannot be the speculative draft: the linear-attention layers' states of the "
                       "proposals it drafts cannot be rolled back when the target rejects them")
# LFM2's (`conv_layers`): the same reasons for its short convolutions' conv windows
PREFIX_CACHING_OFF_CONV = PREFIX_CACHING_OFF.replace("linear-attention", "short-convolution")
SPECULATIVE_REFUSED_CONV = SPECULATIVE_REFUSED.replace("linear-attention", "short-convolution")


def prefix_caching_off(model: Decoder) -> str:
    """Why a hybrid model is served without prefix caching (worded for its kind of state layers)."""
    return PREFIX_CACHING_OFF_CONV if model.state_stack == CONV_STACK else PREFIX_CACHING_OFF


def speculative_refused(model: Decoder) -> str:
    """Why a hybrid model cannot be a speculative draft (worded for its kind of state layers)."""
    return SPECULATIVE_REFUSED_CONV if model.state_stack == CONV_STACK else SPECULATIVE_REFUSED


def is_hybrid(model: Decoder) -> bool:
    """True for a model whose layer pattern reads a stack with per-sequence states (`linear_layers`, LFM2's
    `conv_layers`): it needs state slots to be served."""
    return model.state_stack is not None


def state_pool(model: Decoder, num_slots: int) -> StateCache:
    """Zero states for `num_slots` sequences over the model's state layers: conv [L, N, K - 1, C] in the model's
    activation dtype, recurrent [L, N, H, Dk, Dv] fp32 (none for LFM2's short convolutions)."""
    return StateCache.empty(model.layer_pattern.cache_rows(model.state_stack), num_slots, model.state_shape,
                            model.dtype)


def state_pool_bytes(model: Decoder, num_slots: int) -> int:
    """The device bytes of `state_pool(model, num_slots)` (0 for a model without linear attention)."""
    if not is_hybrid(model):
        return 0
    shapes = jax.eval_shape(lambda: state_pool(model, num_slots))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


class StateSlots:
    """Which state slot each running sequence holds (host side; the pool itself lives on the device)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"StateSlots: num_slots must be >= 1 (got {num_slots})")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest free slot
        self._held: dict[str, int] = {}

    def allocate(self, request_id: str) -> int:
        """A free slot for a sequence that starts (its state is zeroed by the first call that runs it)."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds state slot {self._held[request_id]}")
        if not self._free:
            raise RuntimeError(f"no free state slot for {request_id!r}: all {self.num_slots} are held (the "
                               "scheduler admits at most max_num_seqs running sequences)")
        slot = self._held[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Give back the request's slot (nothing if it holds none: a request aborted while waiting)."""
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, request_id: str) -> int:
        return self._held[request_id]

    @property
    def num_free(self) -> int:
        return len(self._free)


def with_state_rows(kv_cache, pool: StateCache | None, batch, model: Decoder, *, per_token: bool = False) -> Cache:
    """The decoder's cache for one call: `kv_cache` alone (no state pool), or a `HybridCache` of it and the
    rows' states gathered from the pool at ``batch.state_slots`` [R] (zeros where ``batch.start`` is 0), as the
    cache part of the model's state stack (`linear_layers`, LFM2's `conv_layers`). per_token: as a
    `TokenStateCache` (the layers hand back their inputs, replayed to a token chosen after the call: speculative
    verification)."""
    if pool is None:
        return kv_cache
    rows = pool.rows(batch.state_slots, batch.start == 0)
    if per_token:
        rows = TokenStateCache(rows.conv, rows.recurrent)
    return HybridCache(kv_cache, rows, state_stack=model.state_stack)


def split_state_rows(cache, pool: StateCache | None, batch, *, at_token=None):
    """The decoder's cache after a call -> (its KV part, the pool with the rows' new states written back at
    their slots; None without a pool). at_token [R] (a `with_state_rows(per_token=True)` call): each row keeps
    its state after its token at_token[r] of the call (`TokenStateCache.at_tokens`)."""
    if pool is None:
        return cache, None
    state = cache.state if at_token is None else cache.state.at_tokens(at_token)
    return cache.kv, pool.with_rows(batch.state_slots, state)


def pools_and(k_pool, v_pool, pool: StateCache | None, *outputs) -> tuple:
    """A runner call's results: the pools first (k, v, and the state pool when there is one), then its
    outputs."""
    return (k_pool, v_pool, *outputs) if pool is None else (k_pool, v_pool, pool, *outputs)


__all__ = ["PREFIX_CACHING_OFF", "PREFIX_CACHING_OFF_CONV", "SPECULATIVE_REFUSED", "SPECULATIVE_REFUSED_CONV",
           "StateSlots", "is_hybrid", "pools_and", "prefix_caching_off", "speculative_refused",
           "split_state_rows", "state_pool", "state_pool_bytes", "with_state_rows"]
