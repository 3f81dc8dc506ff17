"""The draft model of speculative decoding: a `PagedRunner` over its own pool that mirrors the target's.

The draft pool has the target pool's geometry in blocks (same num_blocks, same block_size; its own layers, KV
heads and head size) and is addressed by the SAME block tables the scheduler hands the target. Every token
whose KV the target writes, the draft writes at the same slot: the engine runs the draft over every prefill
chunk and plain decode row (``execute``, its samples ignored), and ``propose`` writes [last, d_1 .. d_k] at
positions n - 1 .. n - 1 + k, the very tokens the verify step then writes into the target pool. So the draft's
KV of a sequence is valid wherever the target's is (prefix-cache hits included); rolled-back positions are
rewritten before they are read, in both pools alike.

``propose``: k + 1 one-token draft forwards per row in one jitted call (``draft_propose_paged``): forward i feeds
the token at position start + i and draws d_{i+1} (greedy rows: argmax; sampled rows: from the row's filtered
distribution q, keyed ``fold_in(fold_in(key(seed), position), DRAFT)``); the last forward only writes d_k's KV.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.generation.sampling import SamplingParams
from surojax.models.kv import PagedKernel, PagedKVCache
from surojax.models.layer_runner import LayerScan
from surojax.serve.runner import PagedRunner
from surojax.serve.scheduler import ScheduledRequest
from surojax.serve.speculative import DRAFT, filtered_probs, row_keys, sampling_arrays


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens", "sample", "block_size", "unroll", "kernel"),
                   donate_argnames=("k_pool", "v_pool"))
def draft_propose_paged(graphdef, state, k_pool, v_pool, last, start, limit, block_table, rows, num_tokens: int,
                        sample: bool, block_size: int, unroll: int | bool = 1,
                        kernel: PagedKernel = PagedKernel.GATHER):
    """K = num_tokens proposals per row. last/start [R]: the row's last token and its position (= its KV
    length); limit [R]: k_r proposals wanted (forwards 0 .. k_r write KV; -1 on padding rows: nothing written);
    block_table [R, NB] with NB * block_size >= max(start) + K + 1; rows: `speculative.sampling_arrays`.
    -> (k_pool, v_pool, proposals [R, K] int32, q [R, K, V] fp32 or None when no row samples)."""
    model = nnx.merge(graphdef, state)
    cache = PagedKVCache(k_pool, v_pool, block_table, start, block_size, kernel)
    sampled_rows = rows["temperature"] > 0

    def body(carry, i):
        cache, tok = carry
        pos = start + i
        h, cache, _ = model.hidden_states(tok[:, None], pos[:, None], (i <= limit).astype(jnp.int32)[:, None],
                                          cache=cache, runner=LayerScan(unroll=unroll))
        logits = model.logits(h)  # [R, 1, V] fp32
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        if not sample:
            return (cache, nxt), (nxt, None)
        q = filtered_probs(logits, rows)[:, 0]  # [R, V]
        keys = row_keys(rows["seed"], (pos + 1)[:, None], DRAFT)[:, 0]
        drawn = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, q).astype(jnp.int32)
        nxt = jnp.where(sampled_rows, drawn, nxt)
        return (cache, nxt), (nxt, q)

    (cache, _), (ids, q) = jax.lax.scan(body, (cache, last.astype(jnp.int32)), jnp.arange(num_tokens + 1))
    ids = jnp.swapaxes(ids[:num_tokens], 0, 1)  # [R, K]
    q = None if q is None else jnp.swapaxes(q[:num_tokens], 0, 1)  # [R, K, V]
    return cache.k, cache.v, ids, q


class DraftRunner(PagedRunner):
    """The draft model's runner: ``execute`` mirrors the target's prefill / plain decode writes, ``propose``
    drafts the speculative rows' tokens."""

    def propose(self, group: list[ScheduledRequest], num_tokens: int, R: int, S: int):
        """group: the rows to speculate for (decoding; ``num_spec`` proposals each); R, S: the verify call's
        shape (``verify_shape``). -> (proposals [R, K] device int32, num_proposed [R] int32 host, q [R, K, V]
        device or None)."""
        last = np.zeros(R, np.int32)
        start = np.zeros(R, np.int32)
        limit = np.full(R, -1, np.int32)
        params = []
        for r, s in enumerate(group):
            last[r], start[r], limit[r] = s.token_ids[0], s.start, s.num_spec
            params.append(s.sampling_params if isinstance(s.sampling_params, SamplingParams) else SamplingParams())
        rows = sampling_arrays(params, R)
        self.num_calls += 1
        self.k_pool, self.v_pool, ids, q = draft_propose_paged(
            self.graphdef, self.state, self.k_pool, self.v_pool, last, start, limit, self._block_table(group, R, S),
            rows, num_tokens=num_tokens, sample=bool((rows["temperature"] > 0).any()), block_size=self.block_size,
            unroll=self.unroll, kernel=self.kernel)
        return ids, limit, q


__all__ = ["DraftRunner", "draft_propose_paged"]
