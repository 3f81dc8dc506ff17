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

Forced calls (``tool_choice`` "required" or a named function): ``ToolParser.grammar`` writes the llguidance Lark
grammar of an answer that is only calls in the format's layout (``CallSyntax``), each call's arguments a
``%json`` of that function's ``parameters`` schema; it travels in ``SamplingParams.grammar`` and the sampler's
mask makes the model write it (guided.py). A marker the tokenizer holds as one token (``<tool_call>`` in Qwen,
``[TOOL_CALLS]`` in Mistral) is matched by its id (``<[id]>``), which llguidance needs for added tokens and which
keeps the model on the token it was trained to emit; a marker the tokenizer lacks is plain text.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance


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
class Function:
    """One entry of a request's `tools`: the function's name and its arguments' JSON schema."""

    name: str
    parameters: Mapping[str, Any]


# The JSON layout of forced arguments: json.dumps's separators and no other whitespace (guided.JSON_LAYOUT, for
# the same reason: a model that may put whitespace anywhere can fail to close the value). A schema that sets its
# own "x-guidance" keeps it.
_ARGS_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallSyntax:
    """The text of an answer that is only calls, as a format's chat template writes it:
    ``before + call (separator + call)* + after``, each call ``open + {"name": NAME, "<args_key>": ARGS} + close``.
    ``markers``: the texts in it that a tokenizer may hold as one (often special) token."""

    before: str
    open: str
    close: str
    separator: str
    after: str
    args_key: str
    markers: tuple[str, ...] = ()


def _lark_text(text: str, markers: tuple[str, ...], token_id: Callable[[str], int | None]) -> str:
    """Literal text -> a Lark sequence: each marker the tokenizer has as one token becomes ``<[id]>``, the rest
    JSON-quoted string literals ("" -> nothing)."""
    pieces = re.split("(" + "|".join(map(re.escape, markers)) + ")", text) if markers else [text]
    out = []
    for piece in filter(None, pieces):
        tid = token_id(piece) if piece in markers else None
        out.append(f"<[{tid}]>" if tid is not None else json.dumps(piece))
    return " ".join(out)


def call_grammar(syntax: CallSyntax, functions: Sequence[Function], one: bool,
                 token_id: Callable[[str], int | None]) -> str:
    """Lark grammar (llguidance) of an answer that is calls only: one call (``one``) or one or more, each to one
    of ``functions`` with arguments valid against its ``parameters`` schema. ``token_id(text)``: the id of a
    marker the tokenizer holds as one token, else None."""
    if not functions:
        raise ValueError("a call grammar needs at least one function")
    text = lambda t: _lark_text(t, syntax.markers, token_id)  # noqa: E731
    rules = []
    for i, fn in enumerate(functions):
        schema = dict(fn.parameters)
        schema.setdefault("x-guidance", _ARGS_LAYOUT)
        head = f'{syntax.open}{{"name": {json.dumps(fn.name, ensure_ascii=False)}, "{syntax.args_key}": '
        body = " ".join(filter(None, (text(head), "%json " + json.dumps(schema), text("}" + syntax.close))))
        rules.append(f"fn_{i}: {body}")
    calls = "call" if one else " ".join(filter(None, ("call (", text(syntax.separator), "call)*")))
    start = " ".join(filter(None, (text(syntax.before), calls, text(syntax.after))))
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    return llguidance.LLMatcher.grammar_from_lark("\n".join([f"start: {start}", f"call: {alternatives}", *rules]))


@dataclass(frozen=True)
class ToolParser:
    """A named format: its scan, the chat-template text that shows a template teaches it, and how its forced
    calls are written (``syntax``)."""

    name: str
    scan: Callable[[str, bool], Scan]
    template_marker: str
    syntax: CallSyntax

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished answer -> (content, calls with fresh ids)."""
        s = self.scan(text, True)
        return s.content, [ToolCall(new_call_id(), c) for c in s.calls]

    def grammar(self, functions: Sequence[Function], one: bool, token_id: Callable[[str], int | None]) -> str:
        """The Lark grammar of an answer that is only calls in this format (``call_grammar``)."""
        return call_grammar(self.syntax, functions, one, token_id)


TOOL_PARSERS = {p.name: p for p in (
    # Qwen's template: "<tool_call>\n{...}\n</tool_call>", calls one per line
    ToolParser("hermes", scan_hermes, HERMES_OPEN,
               CallSyntax("", HERMES_OPEN + "\n", "\n" + HERMES_CLOSE, "\n", "", "arguments",
                          (HERMES_OPEN, HERMES_CLOSE))),
    ToolParser("mistral", scan_mistral, MISTRAL_MARKER,
               CallSyntax(MISTRAL_MARKER + "[", "", "", ", ", "]", "arguments", (MISTRAL_MARKER,))),
    # Llama 3.x's JSON tool calling: the bare object as the message (<|python_tag|> is for built-in tools)
    ToolParser("llama3_json", scan_llama3_json, LLAMA3_MARKER,
               CallSyntax("", "", "", "; ", "", "parameters")),
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
    """An invalid `tools` / `tool_choice`, or an answer that breaks "required" / a named function (HTTP 400);
    ``param`` names the request field."""

    def __init__(self, message: str, param: str = "tool_choice"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """What a request's `tool_choice` asks of the answer. ``parser`` None: the text is not parsed ("none", or no
    tools). ``required``: at least one call (exactly one when ``one``: `parallel_tool_calls` false);
    ``function``: exactly one call, to that function. ``functions``: the request's tools.

    "required" and a named function are forced while sampling: ``grammar`` is the mask's grammar. ``check`` is
    the safety net for what the grammar cannot rule out: a complete answer whose calls the parser does not see
    (a `stop` string cut into the call; a marker the tokenizer holds as a special token that decoding dropped)."""

    parser: ToolParser | None = None
    required: bool = False
    function: str | None = None
    functions: tuple[Function, ...] = ()
    one: bool = False

    def grammar(self, token_id: Callable[[str], int | None]) -> str | None:
        """The llguidance grammar that forces the calls ("required" / named), None when the answer is free.
        ``token_id``: the tokenizer's id of a marker text held as one token, else None."""
        if not self.required or self.parser is None:
            return None
        functions = [f for f in self.functions if self.function is None or f.name == self.function]
        return self.parser.grammar(functions, self.one or self.function is not None, token_id)

    def check(self, calls: list[ToolCall]) -> None:
        if self.required and not calls:
            raise ToolChoiceError("tool_choice asks for a tool call but the model answered without one")
        wrong = sorted({c.function.name for c in calls} - {self.function}) if self.function else []
        if wrong:
            raise ToolChoiceError(f"tool_choice names the function {self.function!r} but the model called "
                                  f"{', '.join(map(repr, wrong))}")


def parse_tools(tools: list) -> tuple[Function, ...]:
    """`tools` ([{"type": "function", "function": {"name", "description"?, "parameters"?}}]) -> the functions
    (no parameters: an object of any keys). Raises ToolChoiceError (param "tools") for another shape."""
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f'tools[{i}] must be {{"type": "function", "function": {{"name": NAME, ...}}}}',
                                  "tools")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object"}
        if not isinstance(parameters, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions.append(Function(fn["name"], parameters))
    return tuple(functions)


def resolve_tool_choice(tools: list[dict] | None, tool_choice, parser: ToolParser | None,
                        parallel: bool = True) -> ToolChoice:
    """The request's `tools` + `tool_choice` ("none" | "auto" | "required" | {"type": "function", "function":
    {"name"}}; absent = "auto" with tools, "none" without), `parallel_tool_calls` (``parallel``; false: "required"
    forces exactly one call) and the model's parser -> ToolChoice."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice()
    if not tools:
        raise ToolChoiceError(f"tool_choice {tool_choice!r} needs `tools`")
    functions = parse_tools(tools)
    names = {f.name for f in functions}
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolChoiceError('a named tool_choice is {"type": "function", "function": {"name": NAME}}')
        if name not in names:
            raise ToolChoiceError(f"tool_choice names {name!r}, which is not in `tools`")
        choice = ToolChoice(parser, required=True, function=name, functions=functions)
    elif tool_choice in ("auto", "required"):
        choice = ToolChoice(parser, required=tool_choice == "required", functions=functions, one=not parallel)
    else:
        raise ToolChoiceError(f'tool_choice must be "none", "auto", "required" or a named function, '
                              f'got {tool_choice!r}')
    if parser is None and choice.required:
        raise ToolChoiceError("this model's chat template has no tool-call format the server can parse "
                              f"(known: {', '.join(TOOL_PARSERS)}); use tool_choice \"auto\" or \"none\"")
    return choice
