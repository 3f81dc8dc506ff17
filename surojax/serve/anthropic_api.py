"""The Anthropic Messages API, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, converted onto the chat
path (api_server.ChatPath): one engine request, as /v1/chat/completions makes it.

Request -> ChatCompletionRequest (`to_chat`):
    model, max_tokens (required, >= 1), stop_sequences, temperature, top_p, top_k -> the same chat fields (stop)
    system           a string or text blocks -> a system message first
    messages         roles user / assistant; content a string or blocks: ``text``; ``image`` (user: a base64 or url
                     source -> the chat path's image_url part, for a vision model; a text model refuses it);
                     ``tool_use`` (assistant: a tool call, its input as the arguments' JSON); ``tool_result`` (user: a
                     tool message, content a string or text blocks, "Error: " before it when is_error);
                     ``thinking`` (assistant: its reasoning_content). Other block types (document,
                     redacted_thinking, server tools ...) are a 400 naming the block
    tools            ``{"name", "description", "input_schema"}`` -> function tools; tool_choice auto / any / tool /
                     none -> "auto" / "required" / the named function / "none"; disable_parallel_tool_use ->
                     parallel_tool_calls false
    thinking         enabled / adaptive / disabled -> the template's thinking switch (api_convert.thinking_switch);
                     absent: the template's default. budget_tokens is checked as Anthropic checks it (>= 1024,
                     < max_tokens) and is not enforced apart from max_tokens, which caps thinking and text together
    output_config    format ``{"type": "json_schema", "schema"}`` -> response_format (guided output); effort -> the
                     template's reasoning_effort (thinking_switch)
Refused with a 400 when set: container, mcp_servers, context_management.

Answer: content blocks in the order the model wrote them -- ``thinking`` (signature ""), ``text``, ``tool_use``
(``toolu_`` ids; input the parsed arguments) -- built by one `MessageBuilder` from the engine's outputs for both the
streamed and the whole answer. stop_reason: max_tokens (the budget ran out), tool_use (the answer has calls),
stop_sequence (with the stop_sequence that matched), end_turn. A stream is Anthropic's named events:
message_start, ping, then per block content_block_start, content_block_delta (text_delta / thinking_delta /
input_json_delta) ..., content_block_stop, and message_delta (stop_reason, usage) and message_stop.

Errors are Anthropic's shape ``{"type": "error", "error": {"type", "message"}}`` (the message names the field),
with the HTTP status of the OpenAI endpoints (`error_response`); mid-stream, an ``error`` event. The key comes as
``x-api-key`` or a bearer token (api_key); the ``anthropic-version`` header is accepted, whatever its value.
"""
from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from surojax.serve.api_convert import AnswerBuilder, matched_stop, named_event, read_body, thinking_switch
from surojax.serve.api_error import ApiError, ClientGone
from surojax.serve.event_stream import EventStream
from surojax.serve.protocol import ChatCompletionRequest
from surojax.serve.tool_parsers import ToolCall, ToolChoice, ToolChoiceError

if TYPE_CHECKING:
    from surojax.serve.api_server import ChatPath, ChatRun

PATH = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
# fields of the chat request that errors of the chat path name -> the Messages API's field
PARAM = {"response_format": "output_config.format", "stop": "stop_sequences"}
NOT_SERVED = ("container", "mcp_servers", "context_management")


def serves(path: str) -> bool:
    """The request path is one of this API's (its errors take Anthropic's shape)."""
    return path == PATH or path.startswith(PATH + "/")


def error_response(e: ApiError) -> JSONResponse:
    message = e.message
    if e.param is not None:
        field = PARAM.get(e.param, e.param)
        message = message if message.startswith(field) else f"{field}: {message}"
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                                    "message": message}},
                        status_code=e.status, headers=e.headers)


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class CountTokensRequest(_Base):
    model: str
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    max_tokens: int | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic requires it


# ---- request -> chat request ----------------------------------------------------------------------------------

def _texts(content, where: str) -> str:
    """A string, or a list of text blocks, as one text (system, tool_result content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise ApiError(400, f"{where}[{j}] must be a text block ({{\"type\": \"text\", \"text\"}}); got type "
                                f"{kind!r} (only text is served)")
        texts.append(block["text"])
    return "".join(texts)


def _image_url(source, at: str) -> str:
    """An image block's source -> the URL of the chat path's image part: ``{"type": "base64", "media_type",
    "data"}`` a data URL, ``{"type": "url", "url"}`` the URL (the server fetches http(s) only when
    --allow-remote-images)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError(400, f'{at}.source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", '
                        f'"url"}}; got type {kind!r}')


def chat_messages(messages: list) -> list[dict]:
    """Anthropic's messages as chat messages: an assistant's tool_use blocks become its tool_calls, a user's
    tool_result blocks tool messages (before the user's text), thinking blocks the reasoning_content."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be \"user\" or \"assistant\", got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content must be a string or a list of content blocks")
        texts, calls, thinking, tools = [], [], [], []
        parts: list[dict] = []  # a user message's text and image parts in order (its content when it has images)
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise ApiError(400, f"{at}: a tool_use block needs a string id and name")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}),
                                                                                          ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(400, f"{at}: a tool_result block needs a string tool_use_id")
                text = _texts(block.get("content", ""), f"{at}.content")
                tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                              "content": "Error: " + text if block.get("is_error") else text})
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
            else:
                raise ApiError(400, f"{at}.type {kind!r} is not served in a {role} message (blocks: text, "
                                    f"{'tool_use, thinking' if role == 'assistant' else 'image, tool_result'})")
        out += tools
        if role == "user":
            if len(parts) > len(texts):  # images: the chat path's image parts, in the message's order
                out.append({"role": "user", "content": parts})
            elif texts or not tools:
                out.append({"role": "user", "content": "".join(texts)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_tools(tools: list | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"tools[{i}].type {kind!r} is not served: only client tools "
                                '({"name", "description", "input_schema"})', param="tools")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise ApiError(400, f"tools[{i}] needs a string name and an input_schema object", param="tools")
        # OpenAI's key order: a template that writes the tools with tojson writes them as chat requests have them
        fn = {"name": t["name"], **({"description": t["description"]} if isinstance(t.get("description"), str)
                                    else {}), "parameters": t["input_schema"]}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict | None) -> tuple[Any, bool]:
    """-> (the chat API's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": NAME}',
                   param="tool_choice")


def _template_kwargs(req: CountTokensRequest, template: str) -> dict:
    """thinking and output_config.effort -> the chat template's thinking switch."""
    kwargs: dict = {}
    thinking, effort = req.thinking, (req.output_config or {}).get("effort")
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise ApiError(400, f'thinking.type must be "enabled", "adaptive" or "disabled", got {kind!r}',
                           param="thinking")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or budget < 1024:
                raise ApiError(400, f"thinking.budget_tokens must be an integer >= 1024, got {budget!r}",
                               param="thinking")
            if req.max_tokens is not None and budget >= req.max_tokens:
                raise ApiError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                    f"({req.max_tokens})", param="thinking")
        kwargs = thinking_switch(template, kind != "disabled", None, "thinking")
    if effort is not None:
        kwargs |= thinking_switch(template, kwargs.get("enable_thinking", True), effort, "output_config.effort")
    return kwargs


def to_chat(req: CountTokensRequest, template: str) -> ChatCompletionRequest:
    for name in NOT_SERVED:
        if (req.model_extra or {}).get(name):
            raise ApiError(400, f"{name} is not served by this server (leave it out)", param=name)
    messages = chat_messages(req.messages)
    if req.system is not None:
        messages.insert(0, {"role": "system", "content": _texts(req.system, "system")})
    response_format = None
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                           param="output_config")
        response_format = {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt["schema"]}}
    tool_choice, parallel = chat_tool_choice(req.tool_choice)
    return ChatCompletionRequest.model_validate({
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens, "stop": req.stop_sequences,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "tools": chat_tools(req.tools),
        "tool_choice": tool_choice, "parallel_tool_calls": parallel, "response_format": response_format,
        "chat_template_kwargs": _template_kwargs(req, template)})


# ---- engine outputs -> content blocks and events --------------------------------------------------------------

def _tool_input(call: ToolCall):
    return json.loads(call.function.arguments) if call.function.arguments else {}


class MessageBuilder(AnswerBuilder):
    """Engine outputs of one answer -> content blocks, and the stream events that build them (`add`). A block
    stays open while the same kind of text continues (thinking, text); tool calls (complete when the tool parser
    sees them) are blocks of their own."""

    REASONING, TEXT = "thinking", "text"

    def __init__(self, head: dict, tools: ToolChoice, n_prompt: int, stops: list[str], decode):
        super().__init__(tools)
        self.head, self.n_prompt, self.stops, self.decode = head, n_prompt, stops, decode
        self.blocks: list[dict] = []
        self.open: dict | None = None

    def message(self, stop_reason: str | None = None, stop_sequence: str | None = None) -> dict:
        return {**self.head, "content": self.blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.n_prompt, "output_tokens": len(self.out_ids)}}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": {**self.message(), "content": [],
                                                      "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}},
                {"type": "ping"}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text(self, kind: str, delta: str) -> list[dict]:
        """`delta` of thinking ("thinking") or answer ("text") text, in the open block of that kind."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self.blocks.append(block)
            self.open = block
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        self.open[kind] += delta
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": f"{kind}_delta", kind: delta}}]

    def _call(self, call: ToolCall) -> list[dict]:
        events = self._close()
        block = {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.function.name,
                 "input": {}}
        self.blocks.append(block)
        index = len(self.blocks) - 1
        events.append({"type": "content_block_start", "index": index, "content_block": dict(block)})
        block["input"] = _tool_input(call)
        return events + [{"type": "content_block_delta", "index": index,
                          "delta": {"type": "input_json_delta", "partial_json": call.function.arguments}},
                         {"type": "content_block_stop", "index": index}]

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). Raises ToolChoiceError for an answer that breaks a forced tool_choice."""
        if self.finish_reason == "length":
            return "max_tokens", None
        if self.checked_calls():
            return "tool_use", None
        if self.stops and (hit := matched_stop(self.decode(self.out_ids), self.stops)) is not None:
            return "stop_sequence", hit
        return "end_turn", None

    def finish(self) -> list[dict]:
        reason, sequence = self.stop()
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": {"output_tokens": len(self.out_ids)}},
            {"type": "message_stop"}]


# ---- the endpoints --------------------------------------------------------------------------------------------

def register(app: FastAPI, path: ChatPath) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on `app`."""
    state = path.state

    def template() -> str:
        try:
            return state.tokenizer.get_chat_template() or ""
        except Exception:
            return ""

    @app.post(PATH)
    async def create(raw: Request):
        try:
            req = await read_body(raw, MessagesRequest)
            run = path.start(to_chat(req, template()))
            head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                    "model": req.model}
            builder = MessageBuilder(head, run.tools, len(run.ids), req.stop_sequences or [],
                                     lambda ids: state.tokenizer.decode(ids, skip_special_tokens=True))
            if req.stream:
                return EventStream(_events(path, run, builder))
            results = await path.collect(run, raw)
            for o in results[0]:
                builder.add(o)
            return builder.message(*builder.stop())
        except ApiError as e:
            return error_response(e)
        except ToolChoiceError as e:
            return error_response(ApiError(400, str(e), param=e.param))
        except ClientGone:
            raise
        except Exception as e:  # what the app's handler would answer OpenAI-shaped
            return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    @app.post(PATH + "/count_tokens")
    async def count_tokens(raw: Request):
        try:
            req = await read_body(raw, CountTokensRequest)
            ids, _ = path.prompt(to_chat(req, template()))
            return {"input_tokens": len(ids)}
        except ApiError as e:
            return error_response(e)


async def _events(path: ChatPath, run: ChatRun, builder: MessageBuilder):
    try:
        yield "".join(map(named_event, builder.start()))
        async for batch in path.merged(run):
            if text := "".join(named_event(e) for _, o in batch for e in builder.add(o)):
                yield text
        yield "".join(map(named_event, builder.finish()))
    except Exception as e:  # an engine failure, a request the engine ended, a broken tool_choice: an error event
        status = e.status if isinstance(e, ApiError) else 400 if isinstance(e, ToolChoiceError) else 500
        message = getattr(e, "message", None) or str(e)
        yield named_event({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                      "message": message}})
    finally:
        path.abort(run)
