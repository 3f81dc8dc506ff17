"""Multi-step decode: up to K decode steps for every row in ONE jitted call (the runner's fast decode path).

Per call, instead of per token: the host builds the batch arrays once and fetches the sampled ids once. Two KV
paths: ``multi_step_decode_paged`` (the default) carries the paged pool itself through the loop (every layer writes
its new k/v into the pool in place and reads the context through the block tables: ``PagedKVCache``);
``kv_reference.reference_multi_step_decode`` (the reference) gathers each row's context from the pool once into a
dense per-row view and scatters the K new k/v back once; both run ``decode_loop``. Inside, a ``lax.while_loop``
runs one-token forwards (the Decoder appends each token's k/v at position ``start + i``), samples on device with
each row's own parameters and key (``fold_in(key(seed), position)``, as in a single step) and feeds the sampled
token back. A row stops when it samples one of its stop ids or reaches its limit (max_tokens / max_model_len / K,
worked out by the scheduler); a stopped row keeps riding along (its results are masked: not counted, not written
back), and the loop ends early once every row has stopped.

Greedy and seeded results equal K single steps: every step sees the same context values (the view holds the
pool's dtype, as the pool would), the same position and the same key; penalties see each new token as soon
as it is sampled. Stop strings need text and are checked by the engine after the call (it trims the tokens
past the match and finishes the request).

Shapes (`InputBatch` fields): tokens/start/limit [R]; ctx_slots [R, S] with S >= max(start) + K; write_slots [R, K] (pool slots
of positions start .. start+K-1, out of range where no slot was reserved); block_table [R, NB] with
NB * block_size >= max(start) + K; stop_ids [R, M] (-1 = none).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.generation.sampling import MAX_TOP_LOGPROBS, BatchMode, sample_batch
from surojax.peft.multi_lora import set_adapter_rows
from surojax.serve.input_batch import InputBatch, StepSettings, run_decoder
from surojax.serve.kv_pools import paged_cache
from surojax.serve.state_slots import pools_and, split_state_rows, with_state_rows


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("k_pool", "v_pool", "state_pool"))
def multi_step_decode_paged(graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings,
                            state_pool=None):
    """The fast path: the pool rides in the loop carry (``PagedKVCache``); each step every layer writes its new
    k/v into the pool in place and reads the rows' context through ``batch.block_table`` [R, NB] (NB * block_size
    >= max(start) + K). A stopped row's token has segment id 0: not written, its length does not grow.
    Same results as ``reference_multi_step_decode``, and the same pool afterwards (kernel GATHER; REDUCE and
    PALLAS: equal up to float rounding).

    batch: tokens / start / limit / adapter_rows [R], stop_ids [R, M], sampling, block_table; K =
    settings.num_steps; rope_delta [R] or None (image rows: M-RoPE positions = position + delta). A hybrid model: ``state_pool`` and ``batch.state_slots`` (`serve.state_slots`): the rows'
    states ride in the loop's carry (a stopped row's padding token leaves its state unchanged) and are written
    back once. -> (k_pool, v_pool, [state_pool,] result)."""
    model = nnx.merge(graphdef, state)
    if settings.lora:
        set_adapter_rows(model, batch.adapter_rows)
    cache = paged_cache(k_pool, v_pool, batch.block_table.astype(jnp.int32), batch.start.astype(jnp.int32),
                        settings)
    cache = with_state_rows(cache, state_pool, batch, model)

    def forward(cache, tok, pos, done):
        return run_decoder(model, tok, pos, (~done).astype(jnp.int32)[:, None], cache, settings,
                           rope_delta=batch.rope_delta)

    cache, result = decode_loop(model, forward, cache, batch, settings.mode, settings.num_steps)
    cache, state_pool = split_state_rows(cache, state_pool, batch)
    return pools_and(cache.k, cache.v, state_pool, result)


def decode_loop(model, forward, cache, batch: InputBatch, mode: BatchMode, K: int):
    """Up to K one-token steps: ``forward(cache, tokens [R, 1], positions [R, 1], done [R]) -> (h, cache)``,
    then sample, feed back, stop rows. batch: tokens / start / limit [R], stop_ids [R, M], sampling.
    -> (cache, dict(ids [R, K], count [R], logprobs ...))."""
    tokens, start, limit, stop_ids, rows = batch.tokens, batch.start, batch.limit, batch.stop_ids, batch.sampling
    R = tokens.shape[0]
    idx = jnp.arange(R)
    out = dict(ids=jnp.zeros((K, R), jnp.int32))
    if mode.logprobs:
        out.update(logprob=jnp.zeros((K, R), jnp.float32),
                   top_ids=jnp.zeros((K, R, MAX_TOP_LOGPROBS), jnp.int32),
                   top_logprobs=jnp.zeros((K, R, MAX_TOP_LOGPROBS), jnp.float32))
    done = limit <= 0
    count = jnp.zeros((R,), jnp.int32)

    def cond(carry):
        i, _, _, done, *_ = carry
        return (i < K) & ~jnp.all(done)

    def body(carry):
        i, cache, tok, done, count, rows, out = carry
        pos = (start + i)[:, None]
        h, cache = forward(cache, tok[:, None], pos, done)
        logits = model.logits(h)[:, 0]  # [R, V] fp32
        sampled = sample_batch(logits, dict(rows, step=rows["step"] + i), mode)
        new = sampled["ids"]
        out = {k: v.at[i].set(sampled[k]) for k, v in out.items()}
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.any(new[:, None] == stop_ids, axis=1) | (i + 1 >= limit)
        if mode.penalties:  # the new token is seen (as output) from the next step on
            at = start + 1 + i
            rows = dict(rows, seen_ids=rows["seen_ids"].at[idx, at].set(new, mode="drop"),
                        seen_valid=rows["seen_valid"].at[idx, at].set(True, mode="drop"),
                        seen_is_output=rows["seen_is_output"].at[idx, at].set(True, mode="drop"))
        return i + 1, cache, new, done, count, rows, out

    carry = (jnp.int32(0), cache, tokens, done, count, rows, out)
    _, cache, _, _, count, _, out = jax.lax.while_loop(cond, body, carry)
    result = {k: jnp.swapaxes(v, 0, 1) for k, v in out.items()}  # [R, K, ...]
    result["count"] = count
    return cache, result
