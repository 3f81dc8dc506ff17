"""Token ids -> text, one token at a time, for streaming; stop strings; reasoning split at <think> tokens.

* ``IncrementalDetokenizer`` (after vLLM's ``detokenize_incrementally``): decodes a window ``ids[prefix:]``
  and emits what it adds to ``ids[prefix:read]``; a window ending in an incomplete UTF-8 character (decoded
  as U+FFFD) is held back until the next token completes it. The window starts with the last prompt tokens,
  so tokenizers that drop a leading space at the start of a decode (sentencepiece) still get it right.
* ``TextChannel``: one output text with stop strings. The text is cut right before the first stop string;
  while streaming, the last ``max(len(stop)) - 1`` characters are held back, since they may be the start of a
  stop string completed by the next token.
* ``RequestText``: what the engine keeps per request. Reasoning is split on token ids (``<think>`` /
  ``</think>``), not on text, so it works whether or not the tokenizer marks those tokens special. A request
  starts "inside" reasoning when its prompt's last think token is an opening one (templates that open the
  block themselves). A stop token id that finished the request is not part of the text. ``</think>`` releases
  what the reasoning channel holds back for stop strings, so all of the reasoning comes before the content.
"""
from __future__ import annotations

from collections.abc import Sequence

PROMPT_CONTEXT = 6  # prompt tokens at the start of the decode window


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = [int(t) for t in prompt_ids[-PROMPT_CONTEXT:]]
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end: whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""


class TextChannel:
    def __init__(self, detok: IncrementalDetokenizer, stop: Sequence[str] = (), lstrip_newlines: bool = False):
        self.detok = detok
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.lstrip = lstrip_newlines

    def add(self, ids: Sequence[int]) -> bool:
        """Append tokens -> True when a stop string appeared (the text is cut before it)."""
        self._append(self.detok.add(ids))
        return self.stopped

    def _append(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        if self.lstrip and not self.text:
            delta = delta.lstrip("\n")
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """The next delta to send (everything when ``final`` or stopped)."""
        if final:
            self._append(self.detok.flush())
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


class RequestText:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], *, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), think_ids: tuple[int, int] | None = None,
                 skip_special_tokens: bool = True):
        self.stop_token_ids = frozenset(stop_token_ids)
        self.think = think_ids
        self.content = TextChannel(IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens), stop)
        self.reasoning = None
        self.in_reasoning = False
        if think_ids is not None:
            self.reasoning = TextChannel(IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens), stop,
                                         lstrip_newlines=True)
            last = [t for t in prompt_ids if t in think_ids]
            self.in_reasoning = bool(last) and last[-1] == think_ids[0]

    def add(self, token_ids: Sequence[int], finished: bool, finish_reason: str | None = None) -> tuple[str, str, bool]:
        """New tokens -> (content delta, reasoning delta, stop string hit)."""
        ids = list(token_ids)
        if finished and finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        closed = False  # a </think> ended the reasoning: its held-back tail goes out now, before any content
        for t in ids:
            if self.think is not None and t in self.think:
                self.in_reasoning = t == self.think[0]
                if not self.in_reasoning and self.reasoning is not None:
                    self.content.lstrip = True  # "</think>\n\n" -> content starts after the newlines
                    closed = True
                continue
            channel = self.reasoning if self.in_reasoning else self.content
            if channel.add([t]):
                finished = True
                break
        stopped = self.content.stopped or (self.reasoning is not None and self.reasoning.stopped)
        final = finished or stopped
        reasoning = self.reasoning.take(final or closed) if self.reasoning is not None else ""
        return self.content.take(final), reasoning, stopped


def apply_text(out, text: RequestText) -> bool:
    """Detokenise one step's output of a request in place, token by token (``out``: a `RequestOutput`; its
    ``text`` / ``reasoning_text`` get the deltas). A stop string ends it: the tokens (and logprobs) after the one
    that completed the match are dropped, ``finished`` / ``finish_reason`` become True / "stop" -- what single
    steps would have given. -> True when the stop string ended a request the scheduler had not finished (the
    caller finishes it there: its KV blocks are freed)."""
    ids, content, reasoning = out.new_token_ids, [], []
    ended_here = False
    for i, tok in enumerate(ids):
        last = i == len(ids) - 1
        c, r, stopped = text.add([tok], out.finished and last, out.finish_reason if last else None)
        content.append(c)
        reasoning.append(r)
        if stopped:
            if not last or not out.finished:
                ended_here = not out.finished
                out.finished, out.finish_reason = True, "stop"
                out.new_token_ids = ids[:i + 1]
                if out.logprobs is not None:
                    out.logprobs = out.logprobs[:i + 1]
            break
    out.text, out.reasoning_text = "".join(content), "".join(reasoning)
    return ended_here
