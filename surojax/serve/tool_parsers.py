"""Tool calls out of generated text, in each model family's own chat-template format (OpenAI ``tool_calls``).

    hermes       Qwen3 / Qwen2.5 (and ChatML templates that teach it): ``<tool_call>{"name": ..., "arguments": {...}}
                 </tool_call>`` blocks anywhere in the answer; text around them stays content.
    llama3_json  Llama 3.x: ``{"name": ..., "parameters": {...}}`` after ``<|python_tag|>`` or as the whole message
                 (several calls separated by ``;``).
    mistral      Mistral / Mixtral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

Special marker tokens (``<|python_tag|>``, ``[TOOL_CALLS]``) vanish from text decoded with
``skip_special_tokens``, so llama3_json / mistral also take a message that *starts* with ``{`` / ``[`` as calls
when it parses as such; a message that does not parse is content, unchanged.

One pure function per format, ``scan(text, final) -> Scan(content, calls)``: ``content`` is the text that is
surely not part of a call (while ``final`` is False: what can be streamed now), ``calls`` the complete calls.
Contract that makes streaming equal the non-streamed parse: as ``text`` grows, ``content`` and ``calls`` only grow
by appending (``ToolCallStream`` sends the differences). Whitespace that touches a call is not content;
``<tool_call>`` blocks that are not JSON with a "name" stay content.

``parser_for(chat_template, model_type)`` picks the format: the template's markers first (what the model was
trained to emit), then the family (``model_type`` of config.json); None where neither says.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FunctionCall:
    """One parsed call: the function's name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Scan:
    content: str
    calls: tuple[FunctionCall, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A call as the API returns it: ``call_...`` id + the function."""

    id: str
    function: FunctionCall

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- shared pieces --------------------------------------------------------------------------------------------

def _function_call(obj, args_keys: tuple[str, ...]) -> FunctionCall | None:
    """{"name": str, <one of args_keys>: object or JSON string} -> FunctionCall, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return FunctionCall(obj["name"], args)
    return FunctionCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(body: str) -> list | None:
    """Consecutive JSON values separated by whitespace, ``;`` or ``,`` -> the list, None if any part is not JSON."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(body) and body[i] in " \t\r\n;,":
            i += 1
        if i == len(body):
            return values or None
        try:
            value, i = decoder.raw_decode(body, i)
        except ValueError:
            return None
        values.append(value)


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _streamable(text: str, final: bool, marker: str) -> str:
    """Content text while streaming: without a possible partial marker and trailing whitespace (either may turn
    out to touch a call)."""
    if final:
        return text
    return text[:len(text) - _partial_marker(text, marker)].rstrip()


# ---- hermes (Qwen) --------------------------------------------------------------------------------------------

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.S)


def _hermes_call(body: str) -> FunctionCall | None:
    try:
        return _function_call(json.loads(body), ("arguments", "parameters"))
    except ValueError:
        return None


def scan_hermes(text: str, final: bool) -> Scan:
    parts, calls, pos = [], [], 0
    for m in _HERMES_BLOCK.finditer(text):
        call = _hermes_call(m.group(1))
        if call is None:  # not a call: stays in the surrounding text
            continue
        segment = text[pos:m.start()]
        parts.append((segment.strip() if calls else segment.rstrip()))
        calls.append(call)
        pos = m.end()
    tail = text[pos:].lstrip() if calls else text[pos:]
    if not final:
        opened = tail.find(HERMES_OPEN)  # an open block: held until it closes (or the answer ends)
        tail = _streamable(tail if opened < 0 else tail[:opened], False, HERMES_OPEN)
    elif calls:
        tail = tail.rstrip()
    return Scan("".join(parts) + tail, tuple(calls))


# ---- whole-message JSON after an optional marker (llama3_json, mistral) ----------------------------------------

def _scan_marked_json(text: str, final: bool, marker: str, opening: str,
                      decode: Callable[[list], list[FunctionCall] | None]) -> Scan:
    """Calls are ``marker`` + JSON up to the end, or the whole message when it starts with ``opening``."""
    at = text.find(marker)
    if at >= 0:
        head, body = text[:at], text[at + len(marker):]
    elif text.lstrip().startswith(opening):
        head, body = "", text
    elif not final and (not text.strip() or marker.startswith(text.lstrip())):
        return Scan("")  # nothing decided yet
    else:
        return Scan(_streamable(text, final, marker))  # plain content (a marker may still come)
    if not final:
        return Scan(head.rstrip())
    values = _json_values(body)
    calls = decode(values) if values is not None else None
    if not calls:
        return Scan(text)
    return Scan(head.rstrip(), tuple(calls))


def _calls_from(values: list, args_keys: tuple[str, ...]) -> list[FunctionCall] | None:
    """Every value a call object (or a list of them) -> the calls, else None."""
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_function_call(v, args_keys) for v in flat]
    return calls if calls and all(c is not None for c in calls) else None


LLAMA3_MARKER = "<|python_tag|>"
MISTRAL_MARKER = "[TOOL_CALLS]"


def scan_llama3_json(text: str, final: bool) -> Scan:
    return _scan_marked_json(text, final, LLAMA3_MARKER, "{",
                             lambda values: _calls_from(values, ("parameters", "arguments")))


def scan_mistral(text: str, final: bool) -> Scan:
    return _scan_marked_json(text, final, MISTRAL_MARKER, "[",
                             lambda values: _calls_from(values, ("arguments", "parameters")))


# ---- registry -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolParser:
    """A named format: its scan and the chat-template text that shows a template teaches it."""

    name: str
    scan: Callable[[str, bool], Scan]
    template_marker: str

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished answer -> (content, calls with fresh ids)."""
        s = self.scan(text, True)
        return s.content, [ToolCall(new_call_id(), c) for c in s.calls]


TOOL_PARSERS = {p.name: p for p in (
    ToolParser("hermes", scan_hermes, HERMES_OPEN),
    ToolParser("mistral", scan_mistral, MISTRAL_MARKER),
    ToolParser("llama3_json", scan_llama3_json, LLAMA3_MARKER),
)}
FAMILY_PARSER = {"qwen2": "hermes", "qwen3": "hermes", "qwen2_moe": "hermes", "qwen3_moe": "hermes",
                 "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral"}


def parser_for(chat_template: str | None, model_type: str | None) -> ToolParser | None:
    """The template's own marker wins (a Llama fine-tuned on a ChatML template emits <tool_call>); then the family."""
    for parser in TOOL_PARSERS.values():
        if chat_template and parser.template_marker in chat_template:
            return parser
    name = FAMILY_PARSER.get(model_type or "")
    return TOOL_PARSERS[name] if name else None


# ---- streaming ------------------------------------------------------------------------------------------------

@dataclass
class StreamDelta:
    content: str = ""
    calls: list[tuple[int, ToolCall]] = field(default_factory=list)  # (index among this answer's calls, call)


class ToolCallStream:
    """Text deltas of one answer -> content deltas and complete calls, equal in sum to ``parser.parse`` of the
    whole text. A call is sent once it is complete (its closing tag, or the end of the answer for the
    whole-message formats)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.calls: list[ToolCall] = []

    def add(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        s = self.parser.scan(self.text, final)
        content, self.sent_content = s.content[self.sent_content:], max(self.sent_content, len(s.content))
        new = [ToolCall(new_call_id(), c) for c in s.calls[len(self.calls):]]
        out = StreamDelta(content, [(len(self.calls) + i, c) for i, c in enumerate(new)])
        self.calls.extend(new)
        return out


# ---- tool_choice ----------------------------------------------------------------------------------------------

class ToolChoiceError(ValueError):
    """An invalid `tools` / `tool_choice`, or an answer that breaks "required" / a named function (HTTP 400)."""


@dataclass(frozen=True)
class ToolChoice:
    """What a request's `tool_choice` asks of the answer. ``parser`` None: the text is not parsed ("none", or no
    tools). ``required``: at least one call; ``function``: every call is to that function.

    Without a grammar mask on the sampler, "required" and a named function are checked after the fact: an
    answer that breaks them is refused (`check` raises), never silently returned as text."""

    parser: ToolParser | None = None
    required: bool = False
    function: str | None = None

    def check(self, calls: list[ToolCall]) -> None:
        if self.required and not calls:
            raise ToolChoiceError("tool_choice asks for a tool call but the model answered without one")
        wrong = sorted({c.function.name for c in calls} - {self.function}) if self.function else []
        if wrong:
            raise ToolChoiceError(f"tool_choice names the function {self.function!r} but the model called "
                                  f"{', '.join(map(repr, wrong))}")


def resolve_tool_choice(tools: list[dict] | None, tool_choice, parser: ToolParser | None) -> ToolChoice:
    """The request's `tools` + `tool_choice` ("none" | "auto" | "required" | {"type": "function", "function":
    {"name"}}; absent = "auto" with tools, "none" without) and the model's parser -> ToolChoice."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice()
    if not tools:
        raise ToolChoiceError(f"tool_choice {tool_choice!r} needs `tools`")
    names = {t.get("function", {}).get("name") for t in tools if isinstance(t, dict)}
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolChoiceError('a named tool_choice is {"type": "function", "function": {"name": NAME}}')
        if name not in names:
            raise ToolChoiceError(f"tool_choice names {name!r}, which is not in `tools`")
        choice = ToolChoice(parser, required=True, function=name)
    elif tool_choice in ("auto", "required"):
        choice = ToolChoice(parser, required=tool_choice == "required")
    else:
        raise ToolChoiceError(f'tool_choice must be "none", "auto", "required" or a named function, '
                              f'got {tool_choice!r}')
    if parser is None and choice.required:
        raise ToolChoiceError("this model's chat template has no tool-call format the server can parse "
                              f"(known: {', '.join(TOOL_PARSERS)}); use tool_choice \"auto\" or \"none\"")
    return choice
