"""Next-token sampling from fp32 logits: greedy, temperature, top-k, top-p, min-p.

All functions take logits [B, V] and return token ids [B]. Temperature 0 means greedy (argmax), which is
what every parity and "batching never changes a result" check relies on.

``sample``/``filter_logits``: one set of parameters for the whole batch (``generate.py``).
``sample_batch``: the serving engine's sampler, every row with its own parameters given as [R] arrays
(temperature, top-k, top-p, min-p, penalties, seed), one jitted function per ``BatchMode`` (greedy only /
sampling, with or without the top-k / top-p / min-p sort, penalties, logprobs, an allowed-token bitmask for
structured output: each only when a row of the batch asks for it). A row's random key is
``fold_in(key(seed), position)``, so a seeded request gives the same tokens alone or in any batch, and a greedy
row is a plain argmax whatever its neighbours ask for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> jax.Array:
    """Mask (to -inf) the tokens that top-k / top-p / min-p exclude. logits [B, V] fp32."""
    neg = jnp.finfo(logits.dtype).min
    if top_k and top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if min_p > 0.0:
        probs = jax.nn.softmax(logits, axis=-1)
        logits = jnp.where(probs < min_p * probs.max(axis=-1, keepdims=True), neg, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep a token when the mass before it is < top_p (so the most likely token always stays)
        keep_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return logits


def sample(logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> jax.Array:
    """logits [B, V] -> ids [B] (int32)."""
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits / temperature, top_k, top_p, min_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ---- per-request parameters and the batched sampler used by the serving engine --------------------------------

MAX_TOP_LOGPROBS = 20  # OpenAI's limit; the batched sampler always computes this many when any row asks


class SamplingParamsError(ValueError):
    """An invalid sampling value; `param` names the field (the HTTP layer answers 400 with both)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. Temperature 0 = greedy; ``seed`` None = a fresh seed drawn by the engine."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output (divides positive logits)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: generation ends, the text is cut before the match
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # structured output: llguidance grammar text (surojax/serve/guided.py builds it)
    prompt_logprobs: int | None = None  # score the prompt: each token's logprob + this many alternatives (None: off)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """self, or SamplingParamsError: each bad field's own message (its name, the value, the allowed range),
        joined with "; " when several are bad; `param` names the first."""
        problems: list[tuple[str, str]] = []

        def bad(param, msg):
            problems.append((param, msg))

        least = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt only (prompt logprobs)
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            bad("max_tokens", f"max_tokens must be an integer >= {least}"
                              f"{' (0 only with prompt logprobs)' if least else ''}, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                bad(name, f"{name} must be in [-2, 2], got {v}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            bad("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"stop_token_ids must be token ids in [0, {vocab_size})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if problems:
            raise SamplingParamsError("; ".join(msg for _, msg in problems), problems[0][0])
        return self


@dataclass(frozen=True)
class BatchMode:
    """The static part of a batched sampling call (one compiled variant each)."""

    sample: bool = False  # some row has temperature > 0 (else argmax only)
    filter: bool = False  # some sampling row restricts its tokens by top_k / top_p / min_p (a sort over V)
    penalties: bool = False  # some row uses a penalty
    logprobs: bool = False  # some row wants logprobs
    mask: bool = False  # some row has a grammar: rows["token_bitmask"] [R, W] restricts the tokens
    prompt_logprobs: bool = False  # some row scores its prompt tokens (serve/prompt_logprobs.py)


def _row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """One key per row: fold_in(key(seed), position of the sampled token) -> independent of the batch."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, steps)


def apply_penalties(logits, seen_ids, seen_valid, seen_is_output, repetition, presence, frequency):
    """logits [R, V]; seen_ids/seen_valid/seen_is_output [R, P] (prompt + output tokens, padded);
    repetition/presence/frequency [R]. vLLM's semantics: repetition over prompt and output, the others over the
    output only."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    out_counts = jnp.zeros((R, V), jnp.float32).at[rows, seen_ids].add((seen_valid & seen_is_output).astype(jnp.float32))
    seen = jnp.zeros((R, V), jnp.bool_).at[rows, seen_ids].max(seen_valid)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - presence[:, None] * (out_counts > 0) - frequency[:, None] * out_counts


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [R, V]; bitmask [R, W] int32 with W >= ceil(V / 32): token i is allowed where bit i % 32 of word
    i // 32 is set (llguidance's layout; a row of -1 allows everything). -> logits, disallowed tokens at -inf."""
    idx = jnp.arange(logits.shape[-1])
    allowed = (bitmask[:, idx >> 5] >> (idx & 31)) & 1  # [R, V]; arithmetic shift, the low bit is the one
    return jnp.where(allowed == 1, logits, -jnp.inf)


def sorted_keep_mask(scaled, top_k, top_p, min_p):
    """Per-row top-k / min-p / top-p over temperature-scaled logits [R, V], in descending order.

    -> (order [R, V] token ids by descending logit, sorted logits [R, V], keep [R, V] bool in sorted order).
    The same sets as ``filter_logits`` row by row; top_k <= 0 means off.
    """
    R, V = scaled.shape
    order = jnp.argsort(-scaled, axis=-1)
    s = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    return order, s, keep


def keep_mask(scaled, top_k, top_p, min_p):
    """``sorted_keep_mask``'s keep [R, V] back in vocabulary order: the tokens each row may sample."""
    R, V = scaled.shape
    order, _, keep_sorted = sorted_keep_mask(scaled, top_k, top_p, min_p)
    return jnp.zeros((R, V), bool).at[jnp.arange(R)[:, None], order].set(keep_sorted)


def sample_batch(logits, rows: dict, mode: BatchMode):
    """One token per row with that row's own parameters; greedy rows are argmax whatever the batch holds.

    logits [R, V] fp32; rows holds [R] arrays temperature, top_k, top_p, min_p, seed (uint32), step (int32) and,
    with ``mode.penalties``, repetition / presence / frequency [R] and seen_ids / seen_valid / seen_is_output [R, P];
    with ``mode.mask``, token_bitmask [R, W] int32 (``apply_token_bitmask``: greedy and sampled rows pick only
    allowed tokens; penalties and top-k/p/min-p act on the allowed ones). A sampled row draws from its
    temperature-scaled logits in vocabulary order (Gumbel-max with its own key), restricted by top-k / top-p /
    min-p only with ``mode.filter`` (the sort over V costs more than the draw): a row without a filter draws the
    same token whichever mode its batch runs in.
    -> dict(ids [R] int32, and with ``mode.logprobs``: logprob [R], top_ids [R, 20], top_logprobs [R, 20]).
    Logprobs are of the model's distribution (raw logits), as vLLM reports them.
    """
    out = {}
    if mode.logprobs:
        logp = jax.nn.log_softmax(logits, axis=-1)
    x = logits
    if mode.penalties:
        x = apply_penalties(x, rows["seen_ids"], rows["seen_valid"], rows["seen_is_output"], rows["repetition"],
                            rows["presence"], rows["frequency"])
    if mode.mask:
        x = apply_token_bitmask(x, rows["token_bitmask"])
    ids = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if mode.sample:
        temp = rows["temperature"]
        scaled = x / jnp.where(temp > 0, temp, 1.0)[:, None]
        if mode.filter:
            scaled = jnp.where(keep_mask(scaled, rows["top_k"], rows["top_p"], rows["min_p"]), scaled, -jnp.inf)
        keys = _row_keys(rows["seed"], rows["step"])
        sampled = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled).astype(jnp.int32)
        ids = jnp.where(temp > 0, sampled, ids)
    out["ids"] = ids
    if mode.logprobs:
        out["logprob"] = jnp.take_along_axis(logp, ids[:, None], axis=-1)[:, 0]
        out["top_logprobs"], out["top_ids"] = jax.lax.top_k(logp, MAX_TOP_LOGPROBS)
    return out


def sample_last(model, h, last_idx, rows: dict, mode: BatchMode):
    """h [R, T, D] hidden states of a decoder (`model.logits`) -> `sample_batch` of each row's token
    last_idx [R] (its last real token; logits in fp32)."""
    logits = model.logits(h[jnp.arange(h.shape[0]), last_idx][:, None])[:, 0]  # [R, V]
    return sample_batch(logits, rows, mode)
