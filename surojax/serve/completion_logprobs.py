"""The logprobs of `/v1/completions` as OpenAI's legacy API and vLLM shape them.

* ``legacy_logprobs``: the choice's ``logprobs`` object {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}, one entry per token. With ``echo`` the prompt's tokens come first: the first prompt token has
  no logprob (None in token_logprobs and top_logprobs), every other one its `PromptLogprob`. Each top_logprobs
  dict holds the token itself and then the N most likely tokens (OpenAI: "up to logprobs + 1 elements"), keyed
  by their text; tokens that decode to the same text keep the highest logprob. text_offset: each token's
  character offset in the choice's text (``offset0`` for the first).
* ``vllm_prompt_logprobs``: vLLM's ``prompt_logprobs`` field of a choice: [None, {token id: {"logprob", "rank",
  "decoded_token"}}, ...], the prompt token first, then the top N (rank 1 .. N).

-inf (a token the model cannot produce) is sent as -9999.0, as OpenAI and vLLM do (JSON has no infinity).
"""
from __future__ import annotations

import math

from surojax.serve.prompt_logprobs import PromptLogprob

MIN_LOGPROB = -9999.0


def _finite(v: float) -> float:
    return max(v, MIN_LOGPROB) if not math.isnan(v) else v


def token_text(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def legacy_logprobs(tok, ids: list[int], entries, offset0: int = 0, n: int | None = None) -> dict:
    """ids: the choice's tokens (prompt tokens first with echo); entries: one per id, None (the first prompt token)
    or (logprob, [(id, logprob)] * N), a generated token's, or a `PromptLogprob`; n: the request's logprobs (the
    alternatives kept per token; None: all the entry has)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = offset0
    for t, entry in zip(ids, entries, strict=True):
        s = token_text(tok, t)
        tokens.append(s)
        offsets.append(off)
        off += len(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp, top = (entry.logprob, entry.top) if isinstance(entry, PromptLogprob) else entry
        token_lps.append(_finite(lp))
        d: dict[str, float] = {}
        for i, v in [(t, lp), *top[:n]]:
            key = token_text(tok, i)
            d[key] = max(d.get(key, -math.inf), _finite(v))
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tok, prompt_ids: list[int], scores: list[PromptLogprob | None], n: int) -> list:
    """vLLM's ``prompt_logprobs`` of a choice, with the top ``n`` alternatives of each position."""
    out: list[dict | None] = []
    for t, score in zip(prompt_ids, scores, strict=True):
        if score is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": _finite(score.logprob), "rank": score.rank, "decoded_token": token_text(tok, t)}}
        for rank, (i, v) in enumerate(score.top[:n], 1):
            d[str(i)] = {"logprob": _finite(v), "rank": rank, "decoded_token": token_text(tok, i)}
        out.append(d)
    return out


__all__ = ["MIN_LOGPROB", "legacy_logprobs", "token_text", "vllm_prompt_logprobs"]
