"""Prompt logprobs: the log-probability of every prompt token given the tokens before it, computed in the prefill.

A request asks with ``SamplingParams.prompt_logprobs`` = N (0..20: each prompt token's own logprob, its rank and
the N most likely alternatives at that position; vLLM's ``prompt_logprobs``, OpenAI's ``echo`` + ``logprobs``).
Token 0 has no logprob (nothing precedes it); token i's comes from the logits at position i - 1.

* Device (`score_prompt`, inside the runner's step call): a prefill chunk covering positions p .. p + n - 1
  scores the tokens at p + 1 .. p + n, those that are still prompt tokens (the host sends them as
  ``InputBatch.prompt_targets`` [R, T], -1 elsewhere). Only a call with such a row computes anything
  (``BatchMode.prompt_logprobs``): logits of all T positions, log-softmax, the target's logprob and rank, the
  top 20. The positions are scored in blocks of ``BLOCK`` (``lax.map``), so a long chunk never holds
  [R, T, V] logits at once. Calls without a scoring row compile and run as before.
* Chunked prefill: each chunk scores its own positions, the last one included (its target is the next chunk's
  first token), so the chunks together score every prompt token 1 .. n - 1 exactly once.
* Prefix caching: a cached block has KV but no logits, so a scoring request never reads the prefix cache
  (``Request.skip_prefix_cache``, as vLLM does); its own blocks are still published for others.
* Preemption by recompute scores the prompt again: the engine's `PromptScores` is indexed by position, so the
  recomputed values overwrite the same entries (the same numbers), and a request's scores are handed out once,
  with its first output (the step that finished its prefill).
* max_tokens 0 (score only): the scheduler ends the request "length" after its prefill, without a token.

Host values: ``PromptLogprob(logprob, rank, top)`` per scored position, rank = 1 + the number of other tokens at
least as likely (vLLM's), top = [(token id, logprob)] * N by decreasing logprob.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from surojax.generation.sampling import MAX_TOP_LOGPROBS, BatchMode, SamplingParams, sample_last
from surojax.serve.scheduler import ScheduledRequest

BLOCK = 128  # positions scored at once: [R, BLOCK, V] fp32 logits live at a time


class PromptLogprob(NamedTuple):
    """One prompt token's score: its logprob, its rank (1 = the most likely token) and the top alternatives."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


# ---- device -----------------------------------------------------------------------------------------------------

def score_prompt(model, h, targets, block: int = BLOCK) -> dict:
    """h [R, T, D] final-normed hidden states (`model.logits`), targets [R, T] int32 (the token after each
    position; -1: not scored) -> dict(prompt_logprob [R, T] fp32, prompt_rank [R, T] int32, prompt_top_ids /
    prompt_top_logprobs [R, T, 20]); entries where targets is -1 are don't-care."""
    R, T, D = h.shape

    def score(hb, tb):
        logp = jax.nn.log_softmax(model.logits(hb), axis=-1)  # [R, c, V] fp32
        lp = jnp.take_along_axis(logp, jnp.maximum(tb, 0)[..., None], axis=-1)[..., 0]
        rank = jnp.sum(logp >= lp[..., None], axis=-1, dtype=jnp.int32)
        top_lp, top_ids = jax.lax.top_k(logp, MAX_TOP_LOGPROBS)
        return lp, rank, top_ids.astype(jnp.int32), top_lp

    if T <= block:
        lp, rank, top_ids, top_lp = score(h, targets)
    else:  # T is a power of two (the runner's bucket), so block divides it
        n = T // block
        hs = jnp.swapaxes(h.reshape(R, n, block, D), 0, 1)
        ts = jnp.swapaxes(targets.reshape(R, n, block), 0, 1)
        outs = jax.lax.map(lambda x: score(*x), (hs, ts))
        lp, rank, top_ids, top_lp = (jnp.swapaxes(o, 0, 1).reshape(R, T, *o.shape[3:]) for o in outs)
    return dict(prompt_logprob=lp, prompt_rank=rank, prompt_top_ids=top_ids, prompt_top_logprobs=top_lp)


def step_outputs(model, h, batch, mode: BatchMode) -> dict:
    """What a step call returns: `sample_last` of each row's last token, plus `score_prompt` of
    ``batch.prompt_targets`` when ``mode.prompt_logprobs``."""
    out = sample_last(model, h, batch.last_idx, batch.sampling, mode)
    if mode.prompt_logprobs:
        out = dict(out, **score_prompt(model, h, batch.prompt_targets))
    return out


# ---- host -------------------------------------------------------------------------------------------------------

def wanted(sampling_params) -> int | None:
    """The request's N (None: it does not score its prompt)."""
    return sampling_params.prompt_logprobs if isinstance(sampling_params, SamplingParams) else None


def prompt_targets(s: ScheduledRequest) -> list[int]:
    """The prompt tokens this chunk scores: those after its positions start .. start + n - 1 (none for a request
    that does not ask, or a chunk past the prompt's last token)."""
    if wanted(s.sampling_params) is None or s.request is None:
        return []
    prompt = s.request.prompt_token_ids
    return prompt[s.start + 1:min(s.start + s.num_new_tokens + 1, len(prompt))]


def target_rows(targets: list[list[int]], R: int, T: int) -> np.ndarray | None:
    """``InputBatch.prompt_targets`` [R, T] of a call (rows past ``targets``: padding), or None when no row
    scores (the call then computes nothing for prompts)."""
    if not any(targets):
        return None
    rows = np.full((R, T), -1, np.int32)
    for r, t in enumerate(targets):
        rows[r, :len(t)] = t
    return rows


def read_rows(group: list[ScheduledRequest], targets: list[list[int]], host: dict,
              into: dict[str, dict[int, PromptLogprob]]) -> None:
    """The scores of a call's rows (``host``: its outputs on the host) -> ``into[request id][position]``."""
    for r, (s, t) in enumerate(zip(group, targets)):
        if not t:
            continue
        k = wanted(s.sampling_params)
        got = into.setdefault(s.request_id, {})
        for j in range(len(t)):
            top = [(int(i), float(v)) for i, v in zip(host["prompt_top_ids"][r, j, :k],
                                                     host["prompt_top_logprobs"][r, j, :k])]
            got[s.start + 1 + j] = PromptLogprob(float(host["prompt_logprob"][r, j]), int(host["prompt_rank"][r, j]),
                                                 top)


class PromptScores:
    """One request's prompt logprobs as the steps compute them: position -> `PromptLogprob`."""

    def __init__(self, num_prompt_tokens: int):
        self.num_prompt_tokens = num_prompt_tokens
        self.scores: dict[int, PromptLogprob] = {}

    def update(self, scores: dict[int, PromptLogprob]) -> None:
        self.scores.update(scores)

    def result(self) -> list[PromptLogprob | None]:
        """[None, score of token 1, ..., score of token n - 1]; raises if a position was never scored (a bug)."""
        missing = [p for p in range(1, self.num_prompt_tokens) if p not in self.scores]
        if missing:
            raise RuntimeError(f"prompt logprobs: positions {missing[:5]} were never scored")
        return [None] + [self.scores[p] for p in range(1, self.num_prompt_tokens)]


__all__ = ["BLOCK", "PromptLogprob", "PromptScores", "prompt_targets", "read_rows", "score_prompt", "step_outputs",
           "target_rows", "wanted"]
