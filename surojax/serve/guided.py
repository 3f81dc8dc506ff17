"""Structured output: a request's grammar as a per-step allowed-token bitmask (llguidance).

A grammar (JSON schema, regex, a list of choices, Lark) is compiled to llguidance's grammar text by the
``grammar_from_*`` builders below; that text travels in ``SamplingParams.grammar``. The engine holds one
``GrammarVocab`` (the tokenizer as llguidance sees it: the byte string of every token id) and gives each guided
request a ``GrammarMatcher``. Every step, before the device call, the matchers of the rows that sample write
their allowed tokens as a bitmask [V/32] int32 (bit ``i % 32`` of word ``i // 32`` set = token ``i`` allowed);
the runner ships the [R, V/32] masks with the batch and the sampler sets the logits of disallowed tokens to -inf
on the device (``sampling.apply_token_bitmask``). After the step, each accepted token advances its matcher; when
the grammar can accept nothing more (``finished``: a closed JSON value, the end of a choice), the engine ends the
request with finish_reason "stop".

A grammar the vocabulary cannot spell (no token for `{`, for a tool-call marker ...) is refused when the request
arrives: ``GrammarVocab.unwritable`` (serve/writability.py) says why. Where that bounded search cannot tell and
generation does reach a state no token continues, ``GrammarMatcher.advance`` refuses the sampled token with
``GrammarVocabularyError`` (where, and what the grammar needed) and the engine ends the request with that error.

Why llguidance (docs/serving.md "Structured output" has the measurements): it computes each mask lazily from
the parser state, so a new schema costs no compilation over the whole vocabulary (outlines-core's does, per
schema), and it enforces the JSON-schema features clients use ($ref, anyOf, pattern, min/max, enums, nested
objects and arrays); xgrammar needs torch.

Shapes: V = the model's vocabulary (``cfg.vocab_size``, >= the tokenizer's; ids past the tokenizer are never
allowed), W = ceil(V / 32).
"""
from __future__ import annotations

import functools
import json
import threading
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from surojax.serve.writability import DeadEnd, Vocabulary, find_dead_end
from surojax.wording import json_type

__all__ = ["GrammarError", "GrammarMatcher", "GrammarVocabularyError", "GrammarVocab", "bitmask_width",
           "grammar_from_choice", "grammar_from_json_object", "grammar_from_json_schema", "grammar_from_regex"]


class GrammarError(ValueError):
    """An invalid grammar (schema, regex, choice list); ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GrammarVocabularyError(GrammarError):
    """A request's grammar reached a state no token of the vocabulary continues (the message says where)."""


def bitmask_width(vocab_size: int) -> int:
    """W: int32 words of one row's bitmask for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


# ---- grammar builders: request values -> llguidance grammar text ------------------------------------------------

# JSON is written in one layout, json.dumps's: ", " and ": " and no other whitespace. llguidance's default lets
# whitespace in anywhere, and a model that puts its mass on whitespace then never closes the value (vLLM's known
# failure). A schema may still choose its own layout through its "x-guidance" key.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

def grammar_from_json_schema(schema: dict[str, Any] | str) -> str:
    """A JSON schema (a dict or its JSON text) -> grammar. Raises GrammarError when it is not a JSON object
    (whether the schema itself is valid is checked by ``GrammarVocab.check``)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be a JSON object, got {json_type(schema)}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise GrammarError(str(e)) from None


def grammar_from_json_object() -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return grammar_from_json_schema({"type": "object"})


def grammar_from_regex(regex: str) -> str:
    """The whole output matches ``regex`` (Rust regex syntax: no look-around, no back-references)."""
    if not isinstance(regex, str) or not regex:
        raise GrammarError("the regex must be a non-empty string")
    return llguidance.LLMatcher.grammar_from_regex(regex)


def grammar_from_choice(choices: list[str]) -> str:
    """The output is exactly one of ``choices`` (Lark alternatives of JSON-quoted literals)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("guided_choice must be a non-empty list of non-empty strings")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices)))


# ---- the tokenizer as llguidance sees it, and one request's matcher ----------------------------------------------

class GrammarVocab:
    """llguidance's view of a tokenizer (built once per engine: seconds for a 150k vocabulary).

    tokenizer: surojax ``Tokenizer`` (its ``backend`` is a ``tokenizers.Tokenizer``); vocab_size: the model's V
    (the mask covers it; ids the tokenizer lacks are never allowed); eos_token_id: the token a grammar allows
    once it may end (the request's other stop ids are allowed then too, by ``GrammarMatcher.allow_stop_ids``).
    Thread-safe: ``check`` and ``unwritable`` run on the HTTP side while the engine thread builds matchers.
    """

    _KEEP = 256  # `unwritable` answers kept (one per grammar text)

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None = None):
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        eos = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.vocab_size = vocab_size
        self.width = bitmask_width(n_vocab)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        self._executor = llguidance.LLExecutor()
        self._lock = threading.Lock()  # LLExecutor calls from two threads at once are not documented as safe
        self._dead_ends: dict[str, str | None] = {}  # grammar text -> `unwritable`'s answer (the latest ones)

    def check(self, grammar: str) -> str | None:
        """The grammar's error message, or None when it compiles against this vocabulary."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        return messages[0] if is_error else None

    @functools.cached_property
    def spelling(self) -> Vocabulary:
        """Each token's bytes, for `unwritable` and the messages of a stuck request (made on first use)."""
        return Vocabulary(self.tokenizer)

    @functools.cached_property
    def spells_all_text(self) -> bool:
        return self.spelling.spells_all_text()

    def unwritable(self, grammar: str) -> str | None:
        """Why no token sequence of this vocabulary is a complete output of the (valid) grammar, found by the
        bounded search of serve/writability.py; None when it found one, or could not tell. Answers are kept for
        the last `_KEEP` grammars (clients send the same schema again and again)."""
        if self.spells_all_text:
            return None
        with self._lock:
            if grammar in self._dead_ends:
                return self._dead_ends[grammar]
        dead = find_dead_end(self.spelling, grammar)
        answer = None if dead is None else f"this model's vocabulary cannot write it: {dead.describe()}"
        with self._lock:
            if len(self._dead_ends) >= self._KEEP:
                self._dead_ends.pop(next(iter(self._dead_ends)))
            self._dead_ends[grammar] = answer
        return answer

    def matcher(self, grammar: str, stop_token_ids=()) -> "GrammarMatcher":
        """A fresh matcher at the grammar's start. Raises GrammarError for an invalid grammar."""
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return GrammarMatcher(m, tuple(int(t) for t in stop_token_ids), self, grammar)

    def fill(self, matchers: list["GrammarMatcher"]) -> np.ndarray:
        """The next-token bitmasks of several matchers -> [len(matchers), W] int32, computed in parallel
        (llguidance's thread pool) when there are several."""
        out = np.zeros((len(matchers), self.width), np.int32)
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0].llm, out, 0)
        elif matchers:
            with self._lock:
                llguidance.numpy.fill_next_token_bitmask_par(
                    self._executor, [(m.llm, i) for i, m in enumerate(matchers)], out)
        for i, m in enumerate(matchers):
            m.allow_stop_ids(out[i])
        return out


class GrammarMatcher:
    """One request's position in its grammar, advanced by every token it accepts (host side)."""

    def __init__(self, llm: llguidance.LLMatcher, stop_token_ids: tuple[int, ...], vocab: GrammarVocab,
                 grammar: str):
        self.llm = llm
        self.stop_token_ids = stop_token_ids
        self.vocab = vocab
        self.grammar = grammar
        self.tokens: list[int] = []  # the tokens accepted so far

    def allow_stop_ids(self, mask: np.ndarray) -> None:
        """Where the grammar may end, the request's stop ids are allowed too (not only llguidance's EOS); where it
        may not, EOS is not (llguidance's mask allows it where the grammar forces bytes that no token writes and
        nothing follows them: ending there would cut the output short)."""
        words = mask.view(np.uint32)
        accepting = self.llm.is_accepting()
        for t in self.stop_token_ids if accepting else self.vocab.tokenizer.eos_tokens:
            if t < 32 * words.shape[0]:
                bit = np.uint32(1 << (t & 31))
                words[t >> 5] = words[t >> 5] | bit if accepting else words[t >> 5] & ~bit

    def advance(self, token_id: int) -> None:
        """Accept one sampled token; a stop id or EOS ends the output where the grammar may end. Raises
        GrammarVocabularyError, the token not taken, for a token the grammar does not take, or EOS where it may
        not end: the mask allowed nothing the grammar takes there (a state this vocabulary cannot continue), so
        the sampled token was not really chosen."""
        token_id = int(token_id)
        eos = token_id in self.vocab.tokenizer.eos_tokens
        if self.llm.is_accepting() and (eos or token_id in self.stop_token_ids):
            if eos:  # llguidance's own end: the matcher stops (`finished`), also where the request ignores EOS
                self.llm.consume_token(token_id)
            return
        if eos or self.llm.is_error() or self.llm.validate_tokens([token_id]) != 1:
            raise GrammarVocabularyError(self.dead_end().describe())
        self.llm.consume_token(token_id)
        self.tokens.append(token_id)

    def dead_end(self) -> DeadEnd:
        """Where this matcher is stuck: the text so far and what the grammar forces next (read from a fresh matcher
        given the same tokens: computing a mask where nothing may follow leaves llguidance's in an error state)."""
        fresh = llguidance.LLMatcher(self.vocab.tokenizer, self.grammar, log_level=0)
        fresh.consume_tokens(self.tokens)
        return self.vocab.spelling.dead_end(self.vocab.tokenizer.decode_bytes(self.tokens), fresh.compute_ff_bytes())

    @property
    def finished(self) -> bool:
        """Nothing but the end may follow: the request is complete."""
        return self.llm.is_stopped()
