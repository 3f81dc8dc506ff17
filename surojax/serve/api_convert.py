"""What the Responses API (responses_api) and the Anthropic Messages API (anthropic_api) share as conversions onto
the chat path: reading the JSON body into a pydantic model with a 400 that names the field, the thinking switch
of a chat template, an engine output split into reasoning, text and tool calls, the stop sequence that ended an
answer, named server-sent events.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from surojax.serve.api_error import ApiError
from surojax.serve.tool_parsers import ToolCall, ToolCallStream, ToolChoice

M = TypeVar("M", bound=BaseModel)


async def read_body(raw: Request, model: type[M]) -> M:
    """The request body as `model`; a 400 for a body that is not JSON or not that model (param: the top field)."""
    try:
        body = json.loads(await raw.body())
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", ())]
        raise ApiError(400, f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}" if loc else str(e),
                       param=loc[0] if loc else None) from None


def thinking_switch(template: str, on: bool, effort: str | None, param: str) -> dict:
    """The chat_template_kwargs that turn a template's reasoning on or off: Qwen3's ``enable_thinking``; GPT-OSS's
    ``reasoning_effort`` gets `effort` when one is given. A template that reads neither has no switch: 400 on
    `param` (the request asked for something the model's template cannot do)."""
    kwargs: dict = {}
    if "enable_thinking" in template:
        kwargs["enable_thinking"] = on
    if effort is not None and "reasoning_effort" in template:
        kwargs["reasoning_effort"] = effort
    if not kwargs or (not on and "enable_thinking" not in template):
        raise ApiError(400, f"{param}: this model's chat template has no switch for its reasoning (it reads "
                            "neither enable_thinking nor reasoning_effort); leave the field out", param=param)
    return kwargs


class AnswerBuilder:
    """What a builder of one API's answer (responses_api.ResponseBuilder, anthropic_api.MessageBuilder) shares:
    `add` splits each engine output (`RequestOutput`) into its reasoning delta -> ``_text(REASONING, delta)``,
    its text outside tool calls -> ``_text(TEXT, delta)`` and each call the tool parser sees complete ->
    ``_call(call)``, whose events it returns in that order; it counts the answer's tokens and keeps its finish
    reason. The subclass writes the events and the answer in its API's shape."""

    REASONING = TEXT = ""

    def __init__(self, tools: ToolChoice):
        self.tools = tools
        self.calls = ToolCallStream(tools.parser) if tools.parser is not None else None
        self.out_ids: list[int] = []
        self.finish_reason: str | None = None

    def _text(self, kind: str, delta: str) -> list[dict]:
        raise NotImplementedError

    def _call(self, call: ToolCall) -> list[dict]:
        raise NotImplementedError

    def add(self, o) -> list[dict]:
        self.out_ids += o.new_token_ids
        events = self._text(self.REASONING, o.reasoning_text) if o.reasoning_text else []
        content, calls = o.text, []
        if self.calls is not None:
            got = self.calls.add(o.text, final=o.finished)
            content, calls = got.content, [call for _, call in got.calls]
        if content:
            events += self._text(self.TEXT, content)
        for call in calls:
            events += self._call(call)
        if o.finished:
            self.finish_reason = o.finish_reason
        return events

    def checked_calls(self) -> list[ToolCall]:
        """The answer's calls, checked against a forced tool_choice unless max_tokens cut the answer (raises
        ToolChoiceError)."""
        if self.calls is None:
            return []
        if self.finish_reason != "length":
            self.tools.check(self.calls.calls)
        return self.calls.calls


def matched_stop(text: str, stops: Sequence[str]) -> str | None:
    """The stop string that ended an answer whose whole decoded text (stop string included) is `text`: the one
    whose first match ends first (the engine stops at the first completed match); None when none occurs."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s) if s else -1
        if i >= 0 and (best is None or i + len(s) < best[0]):
            best = (i + len(s), s)
    return best[1] if best is not None else None


def named_event(event: dict) -> str:
    """One server-sent event named by its "type" (``event: TYPE`` + ``data: JSON``), as both APIs send them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
