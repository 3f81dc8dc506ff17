"""Speculative decoding: n-gram proposals and the acceptance rule of the verify step.

One speculative step of a decoding sequence with n tokens (its last token, at position n - 1, has no KV yet):

1. propose k <= K tokens d_1 .. d_k: ``ngram_propose`` (prompt lookup, host side) or the draft model
   (``serve.draft``: its own paged pool, k + 1 one-token forwards);
2. verify: ONE target forward over the k + 1 tokens [last, d_1 .. d_k] at positions n - 1 .. n - 1 + k
   (``kv_paged.verify_step``: a prefill-shaped call on the paged pool whose logits at every position are kept);
   logits row i is the target's distribution p_i of the token after d_i (d_0 = last);
3. accept (``accept``): greedy rows take the longest prefix where the target's argmax equals the proposal, then
   the target's argmax at the first mismatch (or after the last proposal: the "bonus" token). Sampled rows use
   the rejection sampling of Leviathan et al. 2023 / Chen et al. 2023: d_i is accepted with probability
   min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn from norm(max(0, p_i - q_i)); if
   every proposal is accepted, from p_k. The emitted tokens are distributed exactly as the target's own samples.
   For n-gram proposals q_i is a point mass on d_i (accept with probability p_i(d_i); on rejection draw from
   p_i with d_i removed).

The scheduler then keeps the KV of [last, d_1 .. d_a] (a accepted) and rolls the sequence back past the
rejected positions (their blocks freed when nothing else lives in them).

p_i is the distribution the plain sampler draws from (temperature, then top-k / min-p / top-p:
``sampling.keep_mask``), so a speculative sampled request follows the same distribution as a plain one.
Randomness is per request: the uniform for d_i uses ``fold_in(fold_in(key(seed), position), ACCEPT)``, the
residual / bonus draw ``... RESIDUAL`` and the draft's own draw ``... DRAFT``, so a seeded request gives the
same tokens alone or in any batch. Requests with penalties or logprobs are decoded without speculation
(``speculation_allowed``).

Shapes: R rows, K proposals (static), V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from surojax.generation.sampling import SamplingParams, keep_mask

ACCEPT, RESIDUAL, DRAFT = 0, 1, 2  # key tags: one independent stream per use


def ngram_propose(tokens: Sequence[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Prompt lookup: for n = n_max down to n_min, find the latest earlier occurrence of the last n tokens that
    k tokens follow (else the latest one) and return (up to k of) the tokens that followed it. [] when no n-gram
    recurs. (The latest occurrence alone would propose a single token in a run of one repeated token or a short
    cycle: its match ends just before the last n tokens.)"""
    arr = np.asarray(tokens, np.int64)
    L = arr.shape[0]
    for n in range(n_max, n_min - 1, -1):
        if L <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # [L - n, n]: occurrences with a successor
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]
            i = int(full[-1] if full.size else hits[-1]) + n
            return arr[i:i + k].tolist()
    return []


def speculation_allowed(params: SamplingParams) -> bool:
    """Penalties depend on every earlier token, logprobs are reported per sampled token and a grammar's mask
    depends on the tokens accepted before it: such requests decode one token per step, without proposals."""
    return not (params.uses_penalties or params.logprobs or params.grammar is not None)


def sampling_arrays(params: Sequence[SamplingParams], R: int) -> dict[str, np.ndarray]:
    """Per-row temperature / top_k / top_p / min_p / seed [R] (padding rows: greedy)."""
    rows = dict(temperature=np.zeros(R, np.float32), top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
                min_p=np.zeros(R, np.float32), seed=np.zeros(R, np.uint32))
    for r, sp in enumerate(params):
        rows["temperature"][r], rows["top_k"][r] = sp.temperature, max(sp.top_k, 0)
        rows["top_p"][r], rows["min_p"][r] = sp.top_p, sp.min_p
        rows["seed"][r] = (sp.seed or 0) & 0xFFFFFFFF
    return rows


def row_keys(seed: jax.Array, positions: jax.Array, tag: int) -> jax.Array:
    """seed [R], positions [R, N] -> keys [R, N]: fold_in(fold_in(key(seed), position), tag)."""
    def one(s, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), tag)

    return jax.vmap(lambda s, ps: jax.vmap(lambda p: one(s, p))(ps))(seed, positions)


def filtered_probs(logits: jax.Array, rows: dict) -> jax.Array:
    """logits [R, N, V] fp32 -> the distribution each row samples from [R, N, V]: softmax of logits /
    temperature over the tokens top-k / min-p / top-p keep (greedy rows: temperature 1, unused)."""
    R, N, V = logits.shape
    temp = rows["temperature"]
    scaled = (logits / jnp.where(temp > 0, temp, 1.0)[:, None, None]).reshape(R * N, V)
    rep = lambda x: jnp.repeat(x, N)  # noqa: E731  [R] -> [R * N]
    keep = keep_mask(scaled, rep(rows["top_k"]), rep(rows["top_p"]), rep(rows["min_p"]))
    return jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1).reshape(R, N, V)


def accept(logits: jax.Array, proposals: jax.Array, num_proposed: jax.Array, draft_probs: jax.Array | None,
           rows: dict, start: jax.Array, *, sample: bool) -> dict:
    """The verify step's decision per row.

    logits [R, K + 1, V] fp32: the target's logits at positions start .. start + K; proposals [R, K] int32;
    num_proposed [R] (k_r <= K; proposals past it are ignored); draft_probs [R, K, V] (the distributions the
    draft drew d_i from) or None = point masses on the proposals (n-gram); rows: `sampling_arrays`; start [R]:
    position of the row's first token (its last sampled one). sample (static): some row has temperature > 0.
    -> dict(ids [R, K + 1]: the emitted tokens d_1 .. d_a then the next token, count [R] = a + 1).
    """
    R, K = proposals.shape
    i = jnp.arange(K)[None, :]
    valid = i < num_proposed[:, None]
    idx = jnp.arange(R)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, K + 1]
    ok = (greedy_ids[:, :K] == proposals) & valid
    if sample:
        p = filtered_probs(logits, rows)  # [R, K + 1, V]
        p_d = jnp.take_along_axis(p[:, :K], proposals[..., None], axis=-1)[..., 0]  # [R, K]
        q = draft_probs if draft_probs is not None else jax.nn.one_hot(proposals, p.shape[-1], dtype=p.dtype)
        q_d = jnp.take_along_axis(q, proposals[..., None], axis=-1)[..., 0]
        pos = start[:, None] + 1 + i  # position of the token d_i stands for
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(row_keys(rows["seed"], pos, ACCEPT))  # [R, K]
        ok = jnp.where((rows["temperature"] > 0)[:, None], (u * q_d < p_d) & valid, ok)  # u < min(1, p/q)
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [R] accepted prefix length
    nxt = greedy_ids[idx, a]
    if sample:
        p_a = p[idx, a]  # [R, V]
        q_a = q[idx, jnp.minimum(a, K - 1)]
        rejected = (a < num_proposed)[:, None]
        resid = jnp.where(rejected, jnp.maximum(p_a - q_a, 0.0), p_a)
        resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p_a)  # p == q: a rejection has probability 0
        keys = row_keys(rows["seed"], (start + 1 + a)[:, None], RESIDUAL)[:, 0]
        drawn = jax.vmap(lambda k, r: jax.random.categorical(k, jnp.log(r)))(keys, resid).astype(jnp.int32)
        nxt = jnp.where(rows["temperature"] > 0, drawn, nxt)
    j = jnp.arange(K + 1)[None, :]
    padded = jnp.concatenate([proposals, jnp.zeros((R, 1), jnp.int32)], axis=1)
    ids = jnp.where(j < a[:, None], padded, jnp.where(j == a[:, None], nxt[:, None], 0))
    return dict(ids=ids, count=a + 1)


@dataclasses.dataclass
class SpecStats:
    """Counters of the verify steps (engine.spec_stats; /metrics). A row-step is one sequence verified once."""

    row_steps: int = 0
    proposed: int = 0
    accepted: int = 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.row_steps += 1
        self.proposed += num_proposed
        self.accepted += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted proposals per sequence per verify step (each step also emits one target token)."""
        return self.accepted / self.row_steps if self.row_steps else 0.0


__all__ = ["SpecStats", "accept", "filtered_probs", "ngram_propose", "sampling_arrays", "speculation_allowed"]
