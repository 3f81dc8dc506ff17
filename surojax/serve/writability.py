"""Can this vocabulary write a complete output of a grammar? Asked when a structured-output request arrives, so that
a grammar the model's tokens cannot spell is a 400 that says why, not a generation that goes nowhere.

A grammar constrains bytes; the model writes tokens. A vocabulary that has a token for every byte UTF-8 text uses
(every byte-level BPE, SentencePiece with byte fallback) can spell any text, so any grammar llguidance compiled is
writable (`spells_all_text`: no search). A smaller vocabulary may lack a character the grammar needs, e.g. no token
for `{` (a JSON schema's first byte) or for a tool-call format's marker.

`find_dead_end` searches for a complete output, token by token, through llguidance's matcher: depth first, the
next tokens in the order that closes a value soonest (the tokens the grammar forces next, longest first; then the
closing `"`, `}`, `]`; then the shortest), each token checked with `validate_tokens` before it is consumed (where
the grammar forces bytes no token writes, llguidance's mask may allow a token it then refuses), a byte string
reached twice explored once. It ends

- with None when it reaches a state where the grammar may end (the output is writable), or when it runs out of
  its budget (`MAX_STEPS` tokens tried, `MAX_DEPTH` deep) first: then it cannot tell, and the request runs (the
  engine ends it with an error if it does get stuck: `serve.engine`);
- with a `DeadEnd` when every way it tried ran into a state no token of the vocabulary can continue: the deepest
  one (what was written, the bytes the grammar forces there) says why.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import llguidance
import numpy as np

MAX_STEPS = 256  # tokens tried per grammar (each checked, most consumed): it runs on the HTTP thread
MAX_DEPTH = 512  # tokens written along one path
CLOSERS = (b'"', b"}", b"]")
UTF8_BYTES = frozenset(range(0xF5)) - {0xC0, 0xC1}  # every byte that occurs in UTF-8 text


@dataclass(frozen=True)
class DeadEnd:
    """A state no token of the vocabulary continues: after `written` (bytes), the grammar forces `needed` next
    (empty when it allows several things, none of which a token writes)."""

    written: bytes
    needed: bytes
    no_token_starts: bool  # no token of the vocabulary starts with needed's first character

    def describe(self) -> str:
        needed = _text(self.needed)
        where = f"after {_text(self.written)!r}" if self.written else "at the start"
        if not self.needed:
            return f"{where} no token of the model's vocabulary can continue it"
        why = (f"no token of the model's vocabulary starts with {needed[:1]!r}" if self.no_token_starts
               else "no token of the model's vocabulary fits there")
        return f"{where} the output must go on with {needed!r}, and {why}"


def _text(b: bytes) -> str:
    return b.decode("utf-8", "backslashreplace")


class Vocabulary:
    """What the search needs of a tokenizer, made once: each token's bytes, the tokens by first byte, their
    lengths and the closers' ids."""

    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.tokenizer = tokenizer
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        self.lengths = np.array([len(b) for b in self.tokens], np.int64)
        self.by_first_byte: dict[bytes, list[int]] = {}
        for t, b in enumerate(self.tokens):
            if b and not tokenizer.is_special_token(t):
                self.by_first_byte.setdefault(b[:1], []).append(t)
        self.closers = [t for c in CLOSERS for t in self.by_first_byte.get(c, ()) if self.tokens[t] == c]
        self.eos = frozenset(tokenizer.eos_tokens)

    def spells_all_text(self) -> bool:
        """Every byte UTF-8 text uses is a token of its own: any text is a token sequence."""
        return all(any(len(self.tokens[t]) == 1 for t in self.by_first_byte.get(bytes([b]), ()))
                   for b in UTF8_BYTES)

    def order(self, matcher: llguidance.LLMatcher, forced: bytes) -> Iterator[int]:
        """The tokens to try next, in order (made as they are asked for: most searches take the first few):
        those spelling the start of the forced bytes, longest first (also where the mask lacks them: llguidance
        computes the mask for after forced bytes it cannot tokenize), then the closers, then every token the mask
        allows, shortest first. Computing the mask may leave `matcher` in an error state: give it a copy."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        if forced:
            yield from sorted((t for t in self.by_first_byte.get(forced[:1], ()) if forced.startswith(self.tokens[t])),
                              key=lambda t: -len(self.tokens[t]))
        yield from (t for t in self.closers if bits[t])
        allowed = np.flatnonzero(bits[:len(self.tokens)])
        lengths = self.lengths[allowed]
        for n in np.unique(lengths):
            yield from allowed[lengths == n].tolist()

    def dead_end(self, written: bytes, forced: bytes) -> DeadEnd:
        return DeadEnd(written, forced, bool(forced) and forced[:1] not in self.by_first_byte)


def find_dead_end(vocab: Vocabulary, grammar: str) -> DeadEnd | None:
    """The module docstring's search: a DeadEnd when no complete output was found and every path tried ended in
    one; None when one was found, or the budget ran out first."""
    return _Search(vocab, grammar).run()


class _Search:
    """One `find_dead_end`: depth first from the grammar's start, one llguidance matcher advanced and rolled back.
    Each mask is computed on a copy of it: computing the mask where nothing may follow puts a matcher in an error
    state (llguidance's "no extension") that no rollback leaves."""

    def __init__(self, vocab: Vocabulary, grammar: str):
        self.vocab = vocab
        self.matcher = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0)
        self.depth = 0
        self.seen: set[bytes] = set()  # byte strings written so far on some path (the grammar's state is theirs)
        self.deepest: DeadEnd | None = None
        self.steps = 0

    def run(self) -> DeadEnd | None:
        if self.matcher.is_error():
            return None  # an invalid grammar: GrammarVocab.check reports it
        return self.deepest if self.search(b"") is False else None

    def search(self, written: bytes) -> bool | None:
        """True: a complete output from here; False: only dead ends; None: the budget ran out."""
        vocab, matcher = self.vocab, self.matcher
        if matcher.is_accepting():
            return True
        if self.depth >= MAX_DEPTH:
            return None
        forced = matcher.compute_ff_bytes()
        candidates = vocab.order(matcher.deep_copy(), forced)  # a copy: see the class docstring
        unknown, tried = False, set()
        for t in candidates:
            if t in tried or t in vocab.eos:  # the end is `is_accepting` (the mask may allow EOS where it may not end)
                continue
            tried.add(t)
            nxt = written + vocab.tokens[t]
            if vocab.tokenizer.is_special_token(t):
                nxt += b"\xff%d" % t  # a special token is not its text: keep it apart from that spelling
            if nxt in self.seen:
                continue
            self.seen.add(nxt)
            self.steps += 1
            if self.steps > MAX_STEPS:
                return None
            if matcher.validate_tokens([t]) != 1:
                continue
            matcher.consume_token(t)
            self.depth += 1
            found = self.search(nxt)
            self.depth -= 1
            matcher.rollback(1)
            if found:
                return True
            unknown = unknown or found is None
            if self.steps > MAX_STEPS:
                return None
        if unknown:
            return None
        if self.deepest is None or len(written) > len(self.deepest.written):
            self.deepest = vocab.dead_end(written, forced)
        return False
