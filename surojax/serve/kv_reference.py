"""The reference KV path of the serving runner: gather, run over a dense view, scatter back.

Each call GATHERS every row's context from the pool into a view k/v [L, R, S, K, H] (view slot j = token
position j), wraps it in a plain `KVCache`, runs the decoder (which writes the new k/v at view slots start ..
start + T - 1 and attends over the view), then SCATTERS those new k/v back to the pool. The paged path
(`kv_paged.paged_step`, `multi_step.multi_step_decode_paged`) computes the same tokens and leaves the same pool
without any view; this module is the twin it is checked against (`KVPath.REFERENCE`, tests, benchmarks).

The host sends slot lists (`ReferenceAccess.address`, this path's `input_batch.KVAccess`): ctx_slots [R, S]
(O(context) numpy per row per step) and the new tokens' slots. No speculative decoding on this path. A hybrid
model's linear layers' states: as on the paged path (`serve.state_slots`).

FP8 pool (``scales`` a `kv_fp8.KVScales`): the gathered view is dequantised to the model's dtype and the new k/v
are quantised on the scatter back. The call's own new tokens are attended at the compute dtype (the paged path
reads them back from the fp8 pool): the two paths agree up to the fp8 rounding of those tokens only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.kv import KVCache
from surojax.peft.multi_lora import set_adapter_rows
from surojax.serve.input_batch import InputBatch, StepSettings, run_decoder
from surojax.serve.kv_fp8 import KVScales
from surojax.serve.multi_step import decode_loop
from surojax.serve.prompt_logprobs import step_outputs
from surojax.serve.state_slots import pools_and, split_state_rows, with_state_rows


def _view(pool, ctx_slots, scale, dtype):
    """pool [L, N, K, H] at ctx_slots [R, S] -> the view [L, R, S, K, H] (dequantised to `dtype` when scale,
    [L, 1, 1, 1, 1], is given; as stored otherwise)."""
    view = pool[:, ctx_slots]
    return view if scale is None else KVScales.dequantize(view, scale, dtype)


def _scatter(pool, slots, new, scale):
    """new [L, R, T, K, H] into pool [L, N, K, H] at slots [R, T] (>= N dropped), quantised when scale is given."""
    new = new.astype(pool.dtype) if scale is None else KVScales.quantize(new, scale)
    return pool.at[:, slots].set(new, mode="drop")


def _scales(scales: KVScales | None):
    return (None, None) if scales is None else scales.stacked()


def _dense_cache(model, k_pool, v_pool, ctx_slots, lengths, ks, vs) -> KVCache:
    """Every row's context gathered from the pool into a view [L, R, S, K, H] (view slot j = position j)."""
    S = ctx_slots.shape[1]
    j = jnp.arange(S, dtype=jnp.int32)[None, :]
    valid = j < lengths[:, None]  # [R, S]
    return KVCache(
        k=_view(k_pool, ctx_slots, ks, model.dtype),  # [L, R, S, K, H]   <- the gather the paged path removes
        v=_view(v_pool, ctx_slots, vs, model.dtype),
        segment_ids=valid.astype(jnp.int32),
        positions=jnp.where(valid, j, 0).astype(jnp.int32),
        lengths=lengths.astype(jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("k_pool", "v_pool", "state_pool"))
def reference_step(graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings, state_pool=None):
    """batch: tokens / positions / segment_ids / write_slots [R, T]; ctx_slots [R, S]; start / last_idx /
    adapter_rows [R]; sampling: the per-row sampling arrays of `sample_batch`.

    -> (k_pool, v_pool, sampled: dict of `sample_batch` outputs for each row's last real token, and the prompt
    scores of ``batch.prompt_targets`` with ``settings.mode.prompt_logprobs``: `step_outputs`).
    """
    model = nnx.merge(graphdef, state)
    if settings.lora:
        set_adapter_rows(model, batch.adapter_rows)
    R, T = batch.tokens.shape
    ctx_len = batch.start
    ks, vs = _scales(settings.scales)
    cache = with_state_rows(_dense_cache(model, k_pool, v_pool, batch.ctx_slots, ctx_len, ks, vs), state_pool, batch,
                            model)
    h, cache = run_decoder(model, batch.tokens, batch.positions, batch.segment_ids, cache, settings,
                           images=batch.images, rope_positions=batch.rope_positions)
    cache, state_pool = split_state_rows(cache, state_pool, batch)
    idx = jnp.arange(R)
    view = ctx_len[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [R, T] where the model wrote them
    new_k = cache.k[:, idx[:, None], view]  # [L, R, T, K, H]
    new_v = cache.v[:, idx[:, None], view]
    k_pool = _scatter(k_pool, batch.write_slots, new_k, ks)
    v_pool = _scatter(v_pool, batch.write_slots, new_v, vs)
    return pools_and(k_pool, v_pool, state_pool, step_outputs(model, h, batch, settings.mode))


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("k_pool", "v_pool", "state_pool"))
def reference_multi_step_decode(graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings, state_pool=None):
    """The reference: gather each row's context into a dense view, decode over it, scatter the new k/v back.

    batch: tokens / start / limit / adapter_rows [R], stop_ids [R, M], ctx_slots [R, S], write_slots [R, K],
    sampling; K = settings.num_steps.
    -> (k_pool, v_pool, dict(ids [R, K], count [R] = tokens produced per row, and with ``mode.logprobs``
    logprob [R, K], top_ids / top_logprobs [R, K, 20]))."""
    model = nnx.merge(graphdef, state)
    if settings.lora:
        set_adapter_rows(model, batch.adapter_rows)
    R, S = batch.ctx_slots.shape
    K = settings.num_steps
    start = batch.start
    ks, vs = _scales(settings.scales)
    cache = with_state_rows(_dense_cache(model, k_pool, v_pool, batch.ctx_slots, start, ks, vs), state_pool, batch,
                            model)
    ones = jnp.ones((R, 1), jnp.int32)

    def forward(cache, tok, pos, done):  # done rows ride along; their view writes are never scattered back
        if state_pool is not None:  # ... but a done row's token must not advance its linear layers' state
            return run_decoder(model, tok, pos, (~done).astype(jnp.int32)[:, None], cache, settings,
                               rope_delta=batch.rope_delta)
        return run_decoder(model, tok, pos, ones, cache, settings, rope_delta=batch.rope_delta)

    cache, result = decode_loop(model, forward, cache, batch, settings.mode, K)
    cache, state_pool = split_state_rows(cache, state_pool, batch)
    count = result["count"]
    idx = jnp.arange(R)
    steps = jnp.arange(K, dtype=jnp.int32)[None, :]
    view = jnp.minimum(start[:, None] + steps, S - 1)  # [R, K] view slots of positions start .. start+K-1
    # the KV of the token fed at step i is real for i < count (later steps of a stopped row are not)
    write = jnp.where(steps < count[:, None], batch.write_slots, k_pool.shape[1])
    k_pool = _scatter(k_pool, write, cache.k[:, idx[:, None], view], ks)
    v_pool = _scatter(v_pool, write, cache.v[:, idx[:, None], view], vs)
    return pools_and(k_pool, v_pool, state_pool, result)


def _speculation_refused(*args, **kwargs):
    raise ValueError("speculative verification needs a paged KV path")


class ReferenceAccess:
    """The reference path (`input_batch.KVAccess`): slot lists; every call gathers a dense view and scatters
    the new k/v back. No speculative decoding (``verify`` / ``propose`` raise)."""

    step = staticmethod(reference_step)
    multi_step = staticmethod(reference_multi_step_decode)
    verify = staticmethod(_speculation_refused)
    propose = staticmethod(_speculation_refused)

    def __init__(self, block_size: int, num_slots: int):
        self.block_size, self.num_slots = block_size, num_slots

    def _slots(self, block_table: np.ndarray, start: int, stop: int) -> np.ndarray:
        p = np.arange(start, stop)
        bs = self.block_size
        return block_table[p // bs] * bs + p % bs

    def address(self, block_tables, R, S, starts=(), written=(), width=0) -> dict[str, np.ndarray]:
        """ctx_slots [R, S] (the pool slots of positions 0 .. start - 1; O(context) numpy per row per call) and
        write_slots [R, width] (of positions start .. start + written - 1; out of range elsewhere: dropped)."""
        write = np.full((R, width), self.num_slots, np.int32)
        ctx = np.zeros((R, S), np.int32)
        for r, (table, st, n) in enumerate(zip(block_tables, starts, written)):
            bt = np.asarray(table, np.int64)
            write[r, :n] = self._slots(bt, st, st + n)
            ctx[r, :st] = self._slots(bt, 0, st)
        return dict(ctx_slots=ctx, write_slots=write)


__all__ = ["ReferenceAccess", "reference_multi_step_decode", "reference_step"]
