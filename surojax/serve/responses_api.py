"""The OpenAI Responses API, ``POST /v1/responses`` (``GET /v1/responses/{id}`` for stored ones, ``POST
/v1/responses/input_tokens`` for a request's prompt tokens), converted onto the chat path (api_server.ChatPath):
one engine request, as /v1/chat/completions makes it.

Request -> ChatCompletionRequest (`to_chat`):
    input            a string (one user message) or a list of items: ``message`` (roles system, developer, user,
                     assistant; content a string or ``input_text`` / ``output_text`` parts, and a user's
                     ``input_image`` parts with an image_url: the chat path's image parts, for a vision model),
                     ``function_call``
                     (an assistant tool call: call_id, name, arguments), ``function_call_output`` (a tool message),
                     ``reasoning`` (the reasoning of the next assistant message: its content, else its
                     encrypted_content as this server writes it, else its summary); any other item type is a 400
    instructions     a system message before everything
    previous_response_id  the stored conversation of that response goes before `input` (its instructions do not)
    max_output_tokens, temperature, top_p -> max_tokens, temperature, top_p
    tools            flat function tools ``{"type": "function", "name", "description", "parameters"}``; tool_choice
                     "none" | "auto" | "required" | ``{"type": "function", "name"}``; parallel_tool_calls
    text.format      ``text`` | ``json_object`` | ``json_schema`` (name, schema, strict) -> response_format
    reasoning.effort the template's thinking switch (api_convert.thinking_switch): "none" turns it off
    include          "reasoning.encrypted_content": reasoning items carry their text as encrypted_content too
                     (base64 of the text), which a later input's reasoning item may bring back instead of content
Refused with a 400 naming the field when set (they would change the answer and are not served): background,
conversation, include values other than that one, max_tool_calls, prompt, top_logprobs, truncation "auto",
reasoning.summary "concise" / "detailed", text.verbosity, tools other than functions, input items other than the
four above.

Answer: output items in the order the model wrote them -- ``reasoning`` (its ``reasoning_text`` content, no
summary), ``message`` (one ``output_text`` part), ``function_call`` (call_id, name, arguments) -- built by one
`ResponseBuilder` from the engine's outputs for both the streamed and the whole answer, so the two are equal by
construction. A stream is the typed event sequence (response.created, response.in_progress, then per item
output_item.added, content_part.added, *.delta ..., *.done, content_part.done, output_item.done, and
response.completed -- or response.incomplete when max_output_tokens cut the answer: status "incomplete",
incomplete_details.reason "max_output_tokens"). Errors are OpenAI-shaped (api_server's handler); one that happens
mid-stream is an ``error`` event.

`store` (default true, as OpenAI): the finished conversation (input and output as chat messages) and the response
object are kept in memory, the newest `STORE_LIMIT` of them, for `previous_response_id` and GET; an id not there
(never stored, or dropped) is a 404 naming the field.
"""
from __future__ import annotations

import base64
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from surojax.serve.api_convert import AnswerBuilder, named_event, read_body, thinking_switch
from surojax.serve.api_error import ApiError
from surojax.serve.event_stream import EventStream
from surojax.serve.protocol import ChatCompletionRequest
from surojax.serve.tool_parsers import ToolChoice, ToolChoiceError

if TYPE_CHECKING:
    from surojax.serve.api_server import ChatPath, ChatRun

PATH = "/v1/responses"
STORE_LIMIT = 1000  # stored responses kept (the oldest go first)
# fields of the chat request that errors of the chat path name -> the Responses API's field
PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")  # vendor extras pass, as on the chat endpoint


class TextFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Base):
    format: TextFormat | None = None
    verbosity: str | None = None  # NOT_SERVED unless "medium" (the default)


class ReasoningConfig(_Base):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # NOT_SERVED unless "auto": no summaries are written
    generate_summary: str | None = None


class ResponsesRequest(_Base):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # INCLUDES; another value is a 400


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a Responses request's fields; input may be left out (previous_response_id)."""
    input: str | list[Any] = Field(default_factory=list)


# what `include` may ask for: reasoning items carry their text as `encrypted_content` too (base64 of the UTF-8 text:
# opaque to the client, read back when the item returns in a later input), for clients that keep no server state
# (store false) and hand the reasoning back that way
ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDES = (ENCRYPTED_REASONING,)


# fields the server does not serve -> the values it takes (absent, or the API's default): another is a 400
NOT_SERVED: dict[str, tuple] = {
    "background": (None, False), "conversation": (None,), "max_tool_calls": (None,),
    "prompt": (None,), "top_logprobs": (None, 0), "truncation": (None, "disabled"),
}


# ---- request -> chat request ----------------------------------------------------------------------------------

def _parts_text(content, where: str, kinds: tuple[str, ...]) -> str:
    """A content string, or a list of text parts of the given types, as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}] must be a text part ({' or '.join(kinds)} with a \"text\"); "
                                f"got type {kind!r} (only text is served)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _user_content(content, where: str) -> str | list[dict]:
    """A user message's content: its text, or, with ``input_image`` parts, the chat path's text and image_url parts
    in order (an image URL: a data URL, or an http(s) one the server fetches only when --allow-remote-images)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _parts_text(content, where, ("input_text",))
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise ApiError(400, f"{where}.content[{j}].image_url must be a string (a data: or http(s) URL; "
                                    "file_id images are not served)", param="input")
            url = {"url": part["image_url"]} | ({"detail": part["detail"]} if part.get("detail") else {})
            parts.append({"type": "image_url", "image_url": url})
        elif isinstance(part, dict) and part.get("type") == "input_text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else None
            raise ApiError(400, f"{where}.content[{j}] must be an input_text part with a \"text\" or an "
                                f"input_image part; got type {kind!r}", param="input")
    return parts


def encrypted(text: str) -> str:
    """A reasoning item's `encrypted_content` (ENCRYPTED_REASONING)."""
    return base64.b64encode(text.encode()).decode()


def _decrypted(content, where: str) -> str:
    try:
        return base64.b64decode(content, validate=True).decode()
    except (TypeError, ValueError):
        raise ApiError(400, f"{where}.encrypted_content is not one this server wrote (base64 of the reasoning's "
                            "text)", param="input") from None


def _need_str(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise ApiError(400, f"{where}.{key} must be a string", param="input")
    return item[key]


def input_messages(items: str | list) -> list[dict]:
    """The Responses API's input (or a response's output items) as chat messages. An assistant's function calls
    join its message (or start one); a reasoning item's text becomes the next assistant message's
    reasoning_content."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    assistant: dict | None = None  # the assistant message the next function call joins
    reasoning: str | None = None

    def new_assistant(content: str) -> dict:
        nonlocal reasoning
        msg = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        messages.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object (an input item)", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"{where}.role must be one of system, developer, user, assistant; got {role!r}",
                               param="input")
            if role == "assistant":
                assistant = new_assistant(_parts_text(item.get("content"), where, ("output_text", "input_text")))
            else:
                content = (_user_content(item.get("content"), where) if role == "user"
                           else _parts_text(item.get("content"), where, ("input_text",)))
                messages.append({"role": role, "content": content})
                assistant = None
        elif kind == "function_call":
            call = {"id": _need_str(item, "call_id", where), "type": "function",
                    "function": {"name": _need_str(item, "name", where),
                                 "arguments": _need_str(item, "arguments", where)}}
            if assistant is None:
                assistant = new_assistant("")
            assistant.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, where, ("input_text", "output_text"))
            messages.append({"role": "tool", "tool_call_id": _need_str(item, "call_id", where), "content": text})
            assistant = None
        elif kind == "reasoning":
            if not item.get("content") and item.get("encrypted_content") is not None:
                reasoning = _decrypted(item["encrypted_content"], where)
            else:
                parts = item.get("content") or item.get("summary") or []
                reasoning = _parts_text(parts, where, ("reasoning_text", "summary_text"))
            assistant = None
        else:
            raise ApiError(400, f"{where}.type {kind!r} is not served (input items: message, function_call, "
                                "function_call_output, reasoning)", param="input")
    return messages


def chat_tools(tools: list | None) -> list[dict] | None:
    """Flat function tools -> the chat API's ``{"type": "function", "function": {...}}``."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"tools[{i}].type {kind!r} is not served: only function tools "
                                '({"type": "function", "name", "parameters"})', param="tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                      if t.get(k) is not None}})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice  # "none" / "auto" / "required" (another string: resolve_tool_choice's 400)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": NAME}',
                   param="tool_choice")


def to_chat(req: ResponsesRequest, history: list[dict], template: str) -> ChatCompletionRequest:
    """The chat request of a Responses request; `history`: the stored conversation before it."""
    if isinstance(req.input, list) and not req.input and not history:
        raise ApiError(400, "input is empty", param="input")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise ApiError(400, f"max_output_tokens must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")
    for name, served in NOT_SERVED.items():
        if (req.model_extra or {}).get(name) not in served:
            raise ApiError(400, f"{name} is not served by this server (leave it out)", param=name)
    for value in req.include or []:
        if value not in INCLUDES:
            raise ApiError(400, f"include {value!r} is not served (served: {', '.join(INCLUDES)})", param="include")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise ApiError(400, "text.verbosity is not served by this server (leave it out)", param="text.verbosity")
    for name in ("summary", "generate_summary"):  # "auto": the reasoning comes back whole, as reasoning_text
        if req.reasoning is not None and getattr(req.reasoning, name) not in (None, "auto"):
            raise ApiError(400, f"reasoning.{name} {getattr(req.reasoning, name)!r} is not served: no summaries are "
                                "written (the reasoning comes back whole as reasoning_text content)",
                           param=f"reasoning.{name}")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
    messages += history + input_messages(req.input)
    kwargs = {}
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs = thinking_switch(template, req.reasoning.effort != "none", req.reasoning.effort, "reasoning.effort")
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None:
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ApiError(400, 'text.format {"type": "json_schema"} needs a schema', param="text.format")
            response_format["json_schema"] = {"name": fmt.name or "response", "schema": fmt.schema_,
                                              "strict": fmt.strict, "description": fmt.description}
    return ChatCompletionRequest.model_validate({
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "response_format": response_format, "chat_template_kwargs": kwargs})


# ---- engine outputs -> output items and events ----------------------------------------------------------------

def reasoning_tokens(prompt_ids: list[int], out_ids: list[int], think: tuple[int, int] | None) -> int:
    """How many of the answer's tokens are inside <think> ... </think> (the markers not counted)."""
    if think is None:
        return 0
    marks = [t for t in prompt_ids if t in think]
    inside, n = bool(marks) and marks[-1] == think[0], 0
    for t in out_ids:
        if t in think:
            inside = t == think[0]
        else:
            n += inside
    return n


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder(AnswerBuilder):
    """Engine outputs of one answer -> output items, and the stream events that build them (`add`). An item stays
    open while the same kind of text continues (reasoning, message); another kind closes it; function calls
    (complete when the tool parser sees them) are items of their own."""

    REASONING, TEXT = "reasoning", "message"

    def __init__(self, head: dict, tools: ToolChoice, prompt_ids: list[int], think: tuple[int, int] | None,
                 encrypt_reasoning: bool = False):
        super().__init__(tools)
        self.head, self.prompt_ids, self.think = head, prompt_ids, think
        self.encrypt_reasoning = encrypt_reasoning  # include ENCRYPTED_REASONING
        self.items: list[dict] = []
        self.open: dict | None = None  # the open reasoning / message item
        self.seq = 0

    def event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def response(self, status: str) -> dict:
        n_out = len(self.out_ids)
        usage = {"input_tokens": len(self.prompt_ids), "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": n_out,
                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens(self.prompt_ids, self.out_ids,
                                                                                self.think)},
                 "total_tokens": len(self.prompt_ids) + n_out}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        done = status in ("completed", "incomplete")
        return {**self.head, "status": status, "incomplete_details": incomplete,
                "output": self.items if done else [], "usage": usage if done else None}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        item["status"] = status
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        if kind == "reasoning_text" and self.encrypt_reasoning:
            item["encrypted_content"] = encrypted(part["text"])
        where = dict(item_id=item["id"], output_index=index, content_index=0)
        done = [self.event(f"response.{kind}.done", **where, text=part["text"],
                            **({"logprobs": []} if kind == "output_text" else {})),
                self.event("response.content_part.done", **where, part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=_copy(item))]
        return done

    def _open(self, kind: str) -> list[dict]:
        """A new reasoning ("reasoning") or answer ("message") item with its one (empty) text part."""
        events = self._close()
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": [], "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events += [self.event("response.output_item.added", output_index=index, item=_copy(item)),
                   self.event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=dict(part))]
        item["content"].append(part)
        return events

    def _text(self, kind: str, delta: str) -> list[dict]:
        """`delta` of reasoning or answer text, in the open item of that kind (opened first if need be)."""
        events = self._open(kind) if self.open is None or self.open["type"] != kind else []
        item = self.open
        item["content"][0]["text"] += delta
        where = dict(item_id=item["id"], output_index=self.items.index(item), content_index=0)
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", **where, delta=delta)]
        return events + [self.event("response.output_text.delta", **where, delta=delta, logprobs=[])]

    def _call(self, call) -> list[dict]:
        events = self._close()
        item = {"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.function.name,
                "arguments": "", "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
        item["arguments"], item["status"] = call.function.arguments, "completed"
        return events + [
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"]),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def finish(self) -> list[dict]:
        """The last events: the open item closed, then response.completed (or .incomplete at max_output_tokens).
        Raises ToolChoiceError for an answer that breaks a forced tool_choice."""
        cut = self.finish_reason == "length"
        self.checked_calls()
        events = self._open("message") if not self.items else []  # an empty answer is an empty message
        events += self._close("incomplete" if cut else "completed")
        status = "incomplete" if cut else "completed"
        return events + [self.event(f"response.{status}", response=self.response(status))]


def _copy(item: dict) -> dict:
    return {k: ([dict(p) for p in v] if isinstance(v, list) else v) for k, v in item.items()}


# ---- the endpoint ---------------------------------------------------------------------------------------------

class ResponseStore:
    """Finished responses by id, the newest `limit`: (conversation as chat messages, the response object)."""

    def __init__(self, limit: int = STORE_LIMIT):
        self.limit, self.entries = limit, OrderedDict()

    def put(self, rid: str, messages: list[dict], response: dict) -> None:
        self.entries[rid] = (messages, response)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def get(self, rid: str, param: str | None) -> tuple[list[dict], dict]:
        if rid not in self.entries:
            raise ApiError(404, f"no stored response with id {rid!r} (responses are kept in memory, the newest "
                                f"{self.limit}, when stored)", param=param)
        return self.entries[rid]


def _head(req: ResponsesRequest, rid: str, model: str) -> dict:
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "error": None,
            "background": False, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt or {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "user": req.user}


def register(app: FastAPI, path: ChatPath) -> None:
    """POST /v1/responses, GET /v1/responses/{id} and POST /v1/responses/input_tokens on `app`."""
    store = ResponseStore()

    def _template() -> str:
        try:
            return path.state.tokenizer.get_chat_template() or ""
        except Exception:
            return ""

    def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
        """The chat request of `req`, after the stored conversation its previous_response_id names."""
        history = store.get(req.previous_response_id, "previous_response_id")[0] if req.previous_response_id else []
        return to_chat(req, history, _template())

    def on_chat_path(call, chat: ChatCompletionRequest):
        """call(chat) on the chat path; its errors name the Responses API's fields (PARAM)."""
        try:
            return call(chat)
        except ApiError as e:
            e.param = PARAM.get(e.param, e.param)
            raise

    @app.post(PATH)
    async def create(raw: Request):
        req = await read_body(raw, ResponsesRequest)
        chat = chat_request(req)
        run = on_chat_path(path.start, chat)
        rid = _id("resp")
        builder = ResponseBuilder(_head(req, rid, req.model or path.state.model_name), run.tools, run.ids,
                                  path.think_ids() if run.split else None, ENCRYPTED_REASONING in (req.include or []))
        conversation = chat.messages[1:] if req.instructions is not None else chat.messages

        def keep(response: dict) -> None:
            if req.store:
                store.put(rid, conversation + input_messages(response["output"]), response)

        if req.stream:
            return EventStream(_events(path, run, builder, keep))
        results = await path.collect(run, raw)
        for o in results[0]:
            builder.add(o)
        try:
            final = builder.finish()[-1]["response"]
        except ToolChoiceError as e:
            raise ApiError(400, str(e), param=e.param) from None
        keep(final)
        return final

    @app.post(PATH + "/input_tokens")
    async def input_tokens(raw: Request):
        """The prompt tokens `create` would queue for this request (template, tools, history, images included)."""
        ids, _ = on_chat_path(path.prompt, chat_request(await read_body(raw, InputTokensRequest)))
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    @app.get(PATH + "/{rid}")
    async def retrieve(rid: str):
        return store.get(rid, None)[1]


async def _events(path: ChatPath, run: ChatRun, builder: ResponseBuilder, keep):
    try:
        yield "".join(map(named_event, builder.start()))
        async for batch in path.merged(run):
            if text := "".join(named_event(e) for _, o in batch for e in builder.add(o)):
                yield text
        events = builder.finish()
        keep(events[-1]["response"])
        yield "".join(map(named_event, events))
    except Exception as e:  # an engine failure, a request the engine ended, a broken tool_choice: an error event
        param = getattr(e, "param", None)
        status = e.status if isinstance(e, ApiError) else 400 if isinstance(e, ToolChoiceError) else 500
        yield named_event(builder.event("error", code=str(status), message=getattr(e, "message", None) or str(e),
                                         param=param))
    finally:
        path.abort(run)
