"""MTP speculation: a checkpoint's multi-token-prediction head (models/mtp.py) proposes, the target verifies.

The head's attention layer keeps keys / values of its own, for every position, so it runs as a `PagedRunner` over
a pool of its own (one layer) with the target pool's geometry, addressed by the SAME block tables, as the draft
model does (`serve.draft`): no separate allocation, preemption or prefix bookkeeping, and the head's KV of a
sequence lives wherever the target's does. (A small per-sequence cache of its own would need the same
allocation, growth and freeing as the pool already has.)

MTP position p holds the head's input (t_{p+1}, h_p): the token AFTER p and the target's final-normed hidden
state AT p. So the head lags the target by one position, and for a sequence whose target KV covers 0 .. m - 1 the
head's covers 0 .. m - 2 and h_{m - 1} waits in ``hidden_pool`` [slots, D], one row per sequence at its state
slot (the Qwen3.5 family is hybrid: every running sequence holds one, `serve.state_slots`).

* ``mirror`` (the target runner's ``hidden_sink``): after every target step and verify call, the target's new
  tokens t_s .. t_{s+n-1} (positions s ..; n: the tokens it keeps, a verify's [last, d_1 .. d_a]) and their
  hidden states h_s .. h_{s+n-1} give the head's positions s - 1 .. s + n - 2: (t_s, pool) then (t_{i+1}, h_i);
  a sequence's first chunk (s = 0) has no position -1 and writes 0 .. n - 2. The pool row becomes h_{s+n-1}.
* ``propose`` (a decoding row: last token t_m at position m, no KV yet; the pool holds h_{m-1}): forward 0 feeds
  (t_m, h_{m-1}) at position m - 1 and draws d_1; forward i >= 1 feeds (d_i, g_{i-1}) at position m - 1 + i,
  g the head's own output (after `mtp.norm`), and draws d_{i+1}: k forwards for k proposals. Greedy rows take the
  argmax, sampled rows draw from their filtered distribution q (`kv_paged.draft_draw`), so the verify step's
  rejection sampling (`speculative.accept`) keeps the target's distribution.

The KV the proposal forwards write past the accepted tokens is rewritten by the next mirror before it is read
(the head reads only positions below its length), as the draft's is.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.generation.sampling import BatchMode, SamplingParams
from surojax.models.layer_runner import LayerScan
from surojax.models.mtp import MTPDecoder
from surojax.serve.config import KVPath, RunnerBuckets
from surojax.serve.input_batch import InputBatch, StepSettings
from surojax.serve.kv_paged import draft_draw
from surojax.serve.kv_pools import paged_cache
from surojax.serve.runner import PagedRunner
from surojax.serve.scheduler import ScheduledRequest
from surojax.serve.speculative import sampling_arrays


def _layers(settings: StepSettings) -> LayerScan:
    return LayerScan(unroll=settings.unroll, carry_cache=settings.kv_in_place)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("k_pool", "v_pool", "hidden_pool"))
def mtp_mirror_paged(graphdef, state, k_pool, v_pool, hidden_pool, batch: InputBatch, settings: StepSettings):
    """The head's KV for a target call's kept tokens (module docstring: ``mirror``).

    batch: tokens [R, T] (positions start .. start + T - 1), hidden [R, T, D] (the target's), start [R], limit [R]
    (the real tokens; 0 on padding rows), state_slots [R] (out of range on padding rows), block_table [R, NB].
    -> (k_pool, v_pool, hidden_pool)."""
    model = nnx.merge(graphdef, state)
    tokens, hidden, start, count, slots = batch.tokens, batch.hidden, batch.start, batch.limit, batch.state_slots
    R, T = tokens.shape
    prev = hidden_pool.at[slots].get(mode="fill", fill_value=0).astype(hidden.dtype)  # [R, D]: h_{start - 1}
    first = start == 0  # no position -1: (t_{i+1}, h_i) at positions 0 .. count - 2
    tok = jnp.where(first[:, None], jnp.roll(tokens, -1, axis=1), tokens)
    h_in = jnp.where(first[:, None, None], hidden, jnp.concatenate([prev[:, None], hidden[:, :-1]], axis=1))
    n = jnp.where(first, count - 1, count)
    length = jnp.where(first, 0, start - 1)  # the head's KV length before the call
    i = jnp.arange(T, dtype=jnp.int32)[None, :]
    cache = paged_cache(k_pool, v_pool, batch.block_table, length, settings)
    out = model.predict(tok, h_in, length[:, None] + i, (i < n[:, None]).astype(jnp.int32), cache=cache,
                        runner=_layers(settings))
    last = jnp.take_along_axis(hidden, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]  # [R, D]
    keep = jnp.where((count > 0)[:, None], last, prev).astype(hidden_pool.dtype)
    return out.cache.k, out.cache.v, hidden_pool.at[slots].set(keep, mode="drop")


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("k_pool", "v_pool", "hidden_pool"))
def mtp_propose_paged(graphdef, state, k_pool, v_pool, hidden_pool, batch: InputBatch, settings: StepSettings):
    """K = settings.num_steps proposals per row from the head (module docstring: ``propose``).

    batch: tokens [R] (the row's last token), start [R] (its position = the target's KV length, >= 1), limit [R]
    (k_r proposals wanted: forwards 0 .. k_r - 1 write KV; -1 on padding rows), state_slots [R], block_table,
    sampling (`speculative.sampling_arrays`).
    -> (k_pool, v_pool, hidden_pool (unchanged), proposals [R, K] int32, q [R, K, V] fp32 or None)."""
    model = nnx.merge(graphdef, state)
    start, limit, rows = batch.start, batch.limit, batch.sampling
    length = jnp.maximum(start - 1, 0)
    cache = paged_cache(k_pool, v_pool, batch.block_table, length, settings)
    h0 = hidden_pool.at[batch.state_slots].get(mode="fill", fill_value=0).astype(model.dtype)  # h_{start - 1}

    def body(carry, i):
        cache, tok, h = carry
        pos = length + i
        out = model.predict(tok[:, None], h[:, None], pos[:, None], (i < limit).astype(jnp.int32)[:, None],
                            cache=cache, runner=_layers(settings))
        nxt, q = draft_draw(model.logits(out.hidden), rows, pos + 2, sample=settings.mode.sample)
        return (out.cache, nxt, out.hidden[:, 0]), (nxt, q)

    (cache, _, _), (ids, q) = jax.lax.scan(body, (cache, batch.tokens.astype(jnp.int32), h0),
                                           jnp.arange(settings.num_steps))
    q = None if q is None else jnp.swapaxes(q, 0, 1)  # [R, K, V]
    return cache.k, cache.v, hidden_pool, jnp.swapaxes(ids, 0, 1), q


class MTPRunner(PagedRunner):
    """The MTP head's runner: ``mirror`` follows the target's calls (its ``hidden_sink``), ``propose`` drafts."""

    scores_prompts = False

    def __init__(self, head: MTPDecoder, *, num_blocks: int, block_size: int, kv_path: KVPath, num_state_slots: int,
                 buckets: RunnerBuckets = RunnerBuckets(), unroll_layers: bool = False):
        """num_state_slots: the target's state slots (one hidden-state row per running sequence)."""
        super().__init__(head, num_blocks=num_blocks, block_size=block_size, kv_path=kv_path, kv_dtype=head.dtype,
                         buckets=buckets, unroll_layers=unroll_layers)
        if not self.paged:
            raise ValueError("MTP speculation needs a paged KV path (auto, paged, reduce, pallas)")
        self.num_hidden_slots = num_state_slots
        self.hidden_pool = self._new_pool((num_state_slots, head.cfg.hidden_size), head.dtype)

    def recover_pools(self) -> bool:
        lost = super().recover_pools()
        if self.hidden_pool.is_deleted():
            self.hidden_pool = self._new_pool(self.hidden_pool.shape, self.hidden_pool.dtype)
            lost = True
        return lost

    def _head_call(self, fn, batch: InputBatch, settings: StepSettings) -> list:
        self.num_calls += 1
        self.k_pool, self.v_pool, self.hidden_pool, *out = fn(self.graphdef, self.state, self.k_pool, self.v_pool,
                                                              self.hidden_pool, batch, settings)
        return out

    def mirror(self, batch: InputBatch, hidden) -> None:
        """The target runner's hidden sink: write the head's KV of a target call's kept tokens (`mtp_mirror_paged`;
        batch: the target call's, ``limit`` its real tokens per row, ``state_slots`` its rows' slots)."""
        if batch.state_slots is None:
            raise RuntimeError("MTP mirror: the target call has no state slots (the MTP head needs a hybrid model)")
        mirror = InputBatch(tokens=batch.tokens, start=batch.start, sampling={}, limit=batch.limit, hidden=hidden,
                            state_slots=batch.state_slots, block_table=batch.block_table)
        self._head_call(mtp_mirror_paged, mirror, self.settings.for_call(BatchMode()))

    def propose(self, group: list[ScheduledRequest], num_tokens: int, R: int, S: int):
        """As `DraftRunner.propose`: -> (proposals [R, K] device int32, num_proposed [R] int32 host, q [R, K, V]
        device or None)."""
        last = np.zeros(R, np.int32)
        start = np.zeros(R, np.int32)
        limit = np.full(R, -1, np.int32)
        slots = np.full(R, self.num_hidden_slots, np.int32)
        params = []
        for r, s in enumerate(group):
            last[r], start[r], limit[r], slots[r] = s.token_ids[0], s.start, s.num_spec, s.state_slot
            params.append(s.sampling_params if isinstance(s.sampling_params, SamplingParams) else SamplingParams())
        rows = sampling_arrays(params, R)
        batch = InputBatch(tokens=last, start=start, sampling=rows, limit=limit, state_slots=slots,
                           **self._address(group, R, S))
        mode = BatchMode(sample=bool((rows["temperature"] > 0).any()))
        ids, q = self._head_call(mtp_propose_paged, batch, self.settings.for_call(mode, num_tokens))
        return ids, limit, q


__all__ = ["MTPRunner", "mtp_mirror_paged", "mtp_propose_paged"]
