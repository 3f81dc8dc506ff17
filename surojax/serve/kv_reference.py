"""The reference KV path of the serving runner: gather, run over a dense view, scatter back.

Each call GATHERS every row's context from the pool into a view k/v [L, R, S, K, H] (view slot j = token
position j), wraps it in a plain `KVCache`, runs the decoder (which writes the new k/v at view slots start ..
start + T - 1 and attends over the view), then SCATTERS those new k/v back to the pool. The paged path
(`runner.paged_step`, `multi_step.multi_step_decode_paged`) computes the same tokens and leaves the same pool
without any view; this module is the twin it is checked against (`KVPath.REFERENCE`, tests, benchmarks).

The host sends slot lists: ctx_slots [R, S] (O(context) numpy per row per step) and the new tokens' slots.

FP8 pool (``scales`` a `kv_fp8.KVScales`): the gathered view is dequantised to the model's dtype and the new k/v
are quantised on the scatter back. The call's own new tokens are attended at the compute dtype (the paged path
reads them back from the fp8 pool): the two paths agree up to the fp8 rounding of those tokens only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.generation.sampling import BatchMode, sample_last
from surojax.models.kv import KVCache
from surojax.models.layer_runner import LayerScan
from surojax.peft.multi_lora import set_adapter_rows
from surojax.serve.kv_fp8 import KVScales
from surojax.serve.multi_step import decode_loop


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


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "lora", "kv_in_place", "unroll", "scales"),
                   donate_argnames=("k_pool", "v_pool"))
def reference_step(graphdef, state, k_pool, v_pool, tokens, positions, segment_ids, ctx_slots, ctx_len, write_slots,
                last_idx, adapter_rows, rows, mode: BatchMode, lora: bool, kv_in_place: bool = False,
                unroll: int | bool = 1, scales: KVScales | None = None):
    """tokens/positions/segment_ids/write_slots [R, T]; ctx_slots [R, S]; ctx_len/last_idx/adapter_rows [R];
    rows: the per-row sampling arrays of `sample_batch`; scales: an FP8 pool's `KVScales` (None: compute dtype).

    -> (k_pool, v_pool, sampled: dict of `sample_batch` outputs for each row's last real token).
    """
    model = nnx.merge(graphdef, state)
    if lora:
        set_adapter_rows(model, adapter_rows)
    R, T = tokens.shape
    S = ctx_slots.shape[1]
    j = jnp.arange(S, dtype=jnp.int32)[None, :]
    valid = j < ctx_len[:, None]  # [R, S]
    ks, vs = _scales(scales)
    cache = KVCache(
        k=_view(k_pool, ctx_slots, ks, model.dtype),  # [L, R, S, K, H]   <- the gather the paged kernel removes
        v=_view(v_pool, ctx_slots, vs, model.dtype),
        segment_ids=valid.astype(jnp.int32),
        positions=jnp.where(valid, j, 0).astype(jnp.int32),
        lengths=ctx_len.astype(jnp.int32),
    )
    h, cache, _ = model.hidden_states(tokens, positions, segment_ids, cache=cache,
                                      runner=LayerScan(unroll=unroll, carry_cache=kv_in_place))
    idx = jnp.arange(R)
    view = ctx_len[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [R, T] where the model wrote them
    new_k = cache.k[:, idx[:, None], view]  # [L, R, T, K, H]
    new_v = cache.v[:, idx[:, None], view]
    k_pool = _scatter(k_pool, write_slots, new_k, ks)
    v_pool = _scatter(v_pool, write_slots, new_v, vs)
    return k_pool, v_pool, sample_last(model, h, last_idx, rows, mode)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "lora", "num_steps", "kv_in_place", "unroll",
                                             "scales"),
                   donate_argnames=("k_pool", "v_pool"))
def reference_multi_step_decode(graphdef, state, k_pool, v_pool, tokens, start, ctx_slots, write_slots, limit, stop_ids,
                      adapter_rows, rows, mode: BatchMode, lora: bool, num_steps: int, kv_in_place: bool = False,
                      unroll: int | bool = 1, scales: KVScales | None = None):
    """The reference: gather each row's context into a dense view, decode over it, scatter the new k/v back.

    -> (k_pool, v_pool, dict(ids [R, K], count [R] = tokens produced per row, and with ``mode.logprobs``
    logprob [R, K], top_ids / top_logprobs [R, K, 20]))."""
    model = nnx.merge(graphdef, state)
    if lora:
        set_adapter_rows(model, adapter_rows)
    R, S = ctx_slots.shape
    K = num_steps
    j = jnp.arange(S, dtype=jnp.int32)[None, :]
    valid = j < start[:, None]  # [R, S]
    ks, vs = _scales(scales)
    cache = KVCache(k=_view(k_pool, ctx_slots, ks, model.dtype), v=_view(v_pool, ctx_slots, vs, model.dtype),
                    segment_ids=valid.astype(jnp.int32),
                    positions=jnp.where(valid, j, 0).astype(jnp.int32), lengths=start.astype(jnp.int32))
    ones = jnp.ones((R, 1), jnp.int32)

    def forward(cache, tok, pos, done):  # done rows ride along; their view writes are never scattered back
        runner = LayerScan(unroll=unroll, carry_cache=kv_in_place)
        return model.hidden_states(tok, pos, ones, cache=cache, runner=runner)[:2]

    cache, result = decode_loop(model, forward, cache, tokens, start, limit, stop_ids, rows, mode, K)
    count = result["count"]
    idx = jnp.arange(R)
    steps = jnp.arange(K, dtype=jnp.int32)[None, :]
    view = jnp.minimum(start[:, None] + steps, S - 1)  # [R, K] view slots of positions start .. start+K-1
    # the KV of the token fed at step i is real for i < count (later steps of a stopped row are not)
    write = jnp.where(steps < count[:, None], write_slots, k_pool.shape[1])
    k_pool = _scatter(k_pool, write, cache.k[:, idx[:, None], view], ks)
    v_pool = _scatter(v_pool, write, cache.v[:, idx[:, None], view], vs)
    return k_pool, v_pool, result


__all__ = ["reference_multi_step_decode", "reference_step"]
