"""The paged KV path of the serving runner: the decoder reads and writes the pool in place through block tables.

The host sends block tables [R, NB] (``InputBatch.block_table``, NB * block_size = S); the decoder gets a
``PagedKVCache``: the pool rides in the layer scan's carry (and the multi-step / draft loops' carries), each
layer writes its new tokens' k/v into its pool slice in place (``.at[].set`` on the donated pool) and attention
gathers only that layer's [R, S, K, H] context through the block table. No [L, R, S, K, H] view exists and
nothing is copied in or out of the loops. Decode rows read the pool by the ``PagedKernel`` of the settings
(gather, multiply + reduce, or the Pallas kernel reading each row's real blocks in place).

`PagedAccess` is this path's `input_batch.KVAccess`: ``step`` (`paged_step`), ``multi_step``
(`multi_step.multi_step_decode_paged`), ``verify`` (`verify_step`, speculative verification; a hybrid model's
state slots kept at each row's last accepted token) and ``propose``
(`draft_propose_paged`, the draft model's proposals). Its twin, checked against it: `kv_reference`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.peft.multi_lora import set_adapter_rows
from surojax.serve.input_batch import InputBatch, StepSettings, run_decoder
from surojax.serve.kv_pools import paged_cache
from surojax.serve.multi_step import multi_step_decode_paged
from surojax.serve.prompt_logprobs import step_outputs
from surojax.serve.speculative import DRAFT, accept, filtered_probs, row_keys
from surojax.serve.state_slots import pools_and, split_state_rows, with_state_rows


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("k_pool", "v_pool", "state_pool"))
def paged_step(graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings, state_pool=None):
    """One forward + sample over the paged pool, no dense view (the twin of `kv_reference.reference_step`):
    each layer writes the new tokens' k/v into its pool slice in place and reads the rows' context through
    ``batch.block_table`` (``settings.fresh``: every row's ``start`` is 0, nothing is read: attention over the
    call's own tokens, `PagedKVCache`). Same values, same pool afterwards. A hybrid model: ``state_pool`` (its linear layers'
    state slots) and ``batch.state_slots`` (`serve.state_slots`: the rows' states gathered, advanced, written
    back).

    batch: tokens / positions / segment_ids [R, T], start / last_idx / adapter_rows [R], sampling, block_table.
    -> (k_pool, v_pool, [state_pool,] sampled: dict of `sample_batch` outputs for each row's last real token, and
    with ``settings.mode.prompt_logprobs`` the prompt scores of ``batch.prompt_targets``: `step_outputs`)."""
    model = nnx.merge(graphdef, state)
    if settings.lora:
        set_adapter_rows(model, batch.adapter_rows)
    cache = with_state_rows(paged_cache(k_pool, v_pool, batch.block_table, batch.start, settings), state_pool, batch,
                            model)
    h, cache = run_decoder(model, batch.tokens, batch.positions, batch.segment_ids, cache, settings,
                           images=batch.images, rope_positions=batch.rope_positions)
    cache, state_pool = split_state_rows(cache, state_pool, batch)
    out = step_outputs(model, h, batch, settings.mode)
    return pools_and(cache.k, cache.v, state_pool, dict(out, hidden=h) if settings.hidden else out)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("k_pool", "v_pool", "state_pool"))
def verify_step(graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings, state_pool=None):
    """Speculative verification: ONE target forward over [last, d_1 .. d_k] per row (a prefill chunk of K + 1
    tokens on the paged pool, as ``paged_step``) whose logits at every position are kept, then
    ``speculative.accept`` (sampled rows when ``settings.mode.sample``).

    batch: tokens [R] (the row's last token), start [R] (its position: the row's KV length), proposals [R, K],
    num_proposed [R] (k_r <= K; -1 on padding rows: nothing written), draft_probs [R, K, V] or None (n-gram),
    block_table [R, NB] with NB * block_size >= max(start) + K + 1, sampling (`speculative.sampling_arrays`).
    The KV of all k_r + 1 tokens is written; the scheduler rolls the rejected ones back. A hybrid model
    (``state_pool``, ``batch.state_slots``: `serve.state_slots`), whose states cannot be rolled back: its layers
    hand back their inputs to the state (`TokenStateCache`) and each row's slot gets its state replayed to its last
    accepted token (index count - 1: [last, d_1 .. d_a]).
    -> (k_pool, v_pool, [state_pool,] dict(ids [R, K + 1], count [R])). With ``settings.lora`` each row runs
    under its adapter (``batch.adapter_rows``): the proposals are checked against the model the row is served by."""
    model = nnx.merge(graphdef, state)
    if settings.lora:
        set_adapter_rows(model, batch.adapter_rows)
    start, proposals, num_proposed = batch.start, batch.proposals, batch.num_proposed
    K = proposals.shape[1]
    j = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    tokens = jnp.concatenate([batch.tokens[:, None], proposals], axis=1).astype(jnp.int32)  # [R, K + 1]
    positions = start[:, None] + j
    segments = (j <= num_proposed[:, None]).astype(jnp.int32)
    cache = with_state_rows(paged_cache(k_pool, v_pool, batch.block_table, start, settings), state_pool, batch, model,
                            per_token=True)
    h, cache = run_decoder(model, tokens, positions, segments, cache, settings)
    logits = model.logits(h)  # [R, K + 1, V] fp32
    out = accept(logits, proposals, num_proposed, batch.draft_probs, batch.sampling, start,
                 sample=settings.mode.sample)
    cache, state_pool = split_state_rows(cache, state_pool, batch, at_token=out["count"] - 1)
    return pools_and(cache.k, cache.v, state_pool, dict(out, hidden=h) if settings.hidden else out)


def draft_draw(logits, rows: dict, position, *, sample: bool):
    """A proposer's next token per row: logits [R, 1, V] fp32 of the token at ``position`` [R] -> (ids [R] int32,
    q [R, V] or None): greedy rows the argmax; with ``sample`` (static: some row samples), sampled rows draw from
    their filtered distribution q keyed ``fold_in(fold_in(key(seed), position), DRAFT)``."""
    nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    if not sample:
        return nxt, None
    q = filtered_probs(logits, rows)[:, 0]  # [R, V]
    keys = row_keys(rows["seed"], position[:, None], DRAFT)[:, 0]
    drawn = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, q).astype(jnp.int32)
    return jnp.where(rows["temperature"] > 0, drawn, nxt), q


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("k_pool", "v_pool"))
def draft_propose_paged(graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings):
    """K = settings.num_steps proposals per row from the draft model: forward i feeds the token at position
    start + i and draws d_{i+1} (greedy rows: argmax; with ``settings.mode.sample``, sampled rows draw from their
    filtered distribution q); the last forward only writes d_k's KV.

    batch: tokens [R] (the row's last token), start [R] (its position = its KV length), limit [R] (k_r proposals
    wanted: forwards 0 .. k_r write KV; -1 on padding rows: nothing written), block_table [R, NB] with
    NB * block_size >= max(start) + K + 1, sampling (`speculative.sampling_arrays`).
    -> (k_pool, v_pool, proposals [R, K] int32, q [R, K, V] fp32 or None when no row samples)."""
    model = nnx.merge(graphdef, state)
    start, limit, rows = batch.start, batch.limit, batch.sampling
    cache = paged_cache(k_pool, v_pool, batch.block_table, start, settings)
    K = settings.num_steps

    def body(carry, i):
        cache, tok = carry
        pos = start + i
        h, cache = run_decoder(model, tok[:, None], pos[:, None], (i <= limit).astype(jnp.int32)[:, None], cache,
                               settings)
        nxt, q = draft_draw(model.logits(h), rows, pos + 1, sample=settings.mode.sample)
        return (cache, nxt), (nxt, q)

    (cache, _), (ids, q) = jax.lax.scan(body, (cache, batch.tokens.astype(jnp.int32)), jnp.arange(K + 1))
    ids = jnp.swapaxes(ids[:K], 0, 1)  # [R, K]
    q = None if q is None else jnp.swapaxes(q[:K], 0, 1)  # [R, K, V]
    return cache.k, cache.v, ids, q


class PagedAccess:
    """The paged path (`input_batch.KVAccess`): block tables; every call reads and writes the pool in place."""

    step = staticmethod(paged_step)
    multi_step = staticmethod(multi_step_decode_paged)
    verify = staticmethod(verify_step)
    propose = staticmethod(draft_propose_paged)

    def __init__(self, block_size: int):
        self.block_size = block_size

    def address(self, block_tables, R, S, starts=(), written=(), width=0) -> dict[str, np.ndarray]:
        """block_table [R, S / block_size] block ids (0 past a row's blocks: never read unmasked, never
        written); the slots of the new tokens are computed on the device."""
        nb = S // self.block_size
        table = np.zeros((R, nb), np.int32)
        for r, bt in enumerate(block_tables):
            bt = bt[:nb]
            table[r, :len(bt)] = bt
        return dict(block_table=table)


__all__ = ["PagedAccess", "draft_draw", "draft_propose_paged", "paged_step", "verify_step"]
