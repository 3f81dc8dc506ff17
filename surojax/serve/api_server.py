"""The OpenAI-compatible HTTP API (FastAPI) over one `AsyncEngine`.

    POST /v1/chat/completions   chat template from the tokenizer (tools passed to it), SSE streaming,
                                reasoning_content split at <think> tokens for thinking templates, tool calls in
                                the model's format -> tool_calls (tool_parsers; streamed too), n choices
    POST /v1/completions        text or token-id prompt(s), n choices each, echo; logprobs with echo include the
                                prompt's tokens, vLLM's prompt_logprobs, max_tokens 0 scores the prompt only
                                (`serve.prompt_logprobs`, shapes in `serve.completion_logprobs`)
    POST /v1/responses, /v1/messages   OpenAI's Responses and Anthropic's Messages APIs (responses_api,
                                anthropic_api): conversions onto the chat path (`ChatPath`, `start_chat`)
    GET  /v1/models             the base model and every loaded LoRA adapter (pick one with "model")
    POST /v1/load_lora_adapter  {"lora_name", "lora_path"}; /v1/unload_lora_adapter {"lora_name"}: only with
                                --allow-runtime-lora (else 403), paths confined to --lora-root (`serve.lora_root`)
    POST /tokenize, /detokenize; GET /tokenizer_info (vLLM's: special tokens, chat template, max length; what
                                lm-evaluation-harness's remote tokenizer reads); GET /health, /metrics (Prometheus text)

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``: 404 for an unknown model (naming the
served ones), 400 for bad JSON, a
message whose role is not one of OpenAI's (system, developer, user, assistant, tool; developer reaches a template
that lacks it as system: `data.chat_roles`), prompt longer than max-model-len, invalid sampling values and invalid
structured-output grammars (response_format / guided_*: the schema or regex is compiled before the request is
queued) and grammars the vocabulary cannot spell (`GrammarVocab.unwritable`; tool_choice for a forced call format),
401 without the --api-key bearer token (everything except /health and /metrics), 403 for runtime LoRA endpoints that
are off, 413 for a body over --max-request-bytes (`serve.body_limit`), 429 + Retry-After when the in-flight limit
(max-num-seqs + max-queue) is reached, 503 + Retry-After while draining or when the engine thread is gone, 500 for
anything unexpected — never a crash. A request the engine ends early (finish_reason "abort" inside: a grammar stuck
where no token continues it, an unloaded adapter) is an error saying why (`_for_client`), never a choice with that
finish reason. A client that disconnects (stream or not) aborts its request(s) at once (the disconnect is awaited,
not polled), which frees their KV blocks before the next engine step.

`n` > 1: n engine requests of one prompt (seeds seed, seed + 1, ... when given; the later ones hit the prompt's
prefix blocks), collected together or streamed interleaved (`_merged`), each chunk naming its choice index.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from surojax.data.chat_roles import role_problem
from surojax.data.tokenizer import ChatTemplateError
from surojax.data.vision_data import TextOnly, VisionData
from surojax.generation.context import ContextLengthError, completion_budget
from surojax.generation.sampling import SamplingParamsError
from surojax.serve import anthropic_api, responses_api
from surojax.serve.api_error import ApiError, ClientGone
from surojax.serve.api_key import ApiKeyAuth
from surojax.serve.async_engine import AsyncEngine, QueueFullError, Refused, Stream
from surojax.serve.body_limit import BodySizeLimit
from surojax.serve.completion_logprobs import legacy_logprobs, vllm_prompt_logprobs
from surojax.serve.config import DEFAULT_MAX_REQUEST_BYTES
from surojax.serve.event_stream import EventStream
from surojax.serve.image_prompt import ImagePrompt, ImagePromptError, messages_have_images, prompt_with_images
from surojax.serve.lora_root import LoraPathRefused, LoraRoot
from surojax.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRARequest,
                                    TokenizeRequest, UnloadLoRARequest)
from surojax.serve.scheduler import RequestStatus
from surojax.serve.tool_parsers import (ToolChoice, ToolChoiceError, ToolParser, ToolCallStream, parser_for,
                                        resolve_tool_choice)
from surojax.wording import json_type

OPEN_PATHS = ("/health", "/metrics")
log = logging.getLogger(__name__)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status, headers=headers)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    eos_ids: tuple[int, ...] = ()
    api_key: str | None = None
    model_path: str = ""
    lora_root: LoraRoot | None = None  # None: runtime LoRA load / unload is off (403)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    vision: VisionData | TextOnly = TextOnly("the served model takes no images")  # vision_data.model_vision
    allow_remote_images: bool = False  # --allow-remote-images: fetch http(s) image URLs (httpx)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def thinking(self) -> bool:
        """The chat template has a <think> block and the tokenizer both think tokens: split reasoning."""
        try:
            template = self.tokenizer.get_chat_template()
        except Exception:
            return False
        return "<think>" in template and self.engine.engine.think_ids() is not None

    @functools.cached_property
    def tool_parser(self) -> ToolParser | None:
        """The tool-call format of this model (`tool_parsers.parser_for`: chat template, then family)."""
        try:
            template = self.tokenizer.get_chat_template()
        except Exception:
            template = None
        return parser_for(template, self.engine.engine.model.cfg.model_type)


# ---- helpers --------------------------------------------------------------------------------------------------

def _resolve_model(state: ServerState, name: str | None) -> str | None:
    """The request's "model" -> adapter name (None = base)."""
    if not name or name == state.model_name:
        return None
    lora = state.engine.engine.lora
    if lora is not None and name in lora.slots:
        return name
    known = served_names(state)
    raise ApiError(404, unknown_model(name, known), "invalid_request_error", "model")


def unknown_model(name: str, served: list[str]) -> str:
    """The 404's message for a "model" the server does not serve (OpenAI's / vLLM's wording, with the names)."""
    return f"The model `{name}` does not exist (served: {', '.join(served)})."


def served_names(state: ServerState) -> list[str]:
    """The base model's name, then its LoRA adapters' (what a request's "model" may name)."""
    lora = state.engine.engine.lora
    return [state.model_name] + (sorted(lora.slots) if lora is not None else [])


def model_cards(state: ServerState) -> list[dict]:
    """/v1/models' entries of one engine: the base model, then each loaded LoRA adapter (parent: the base)."""
    lora = state.engine.engine.lora
    card = {"object": "model", "created": state.created, "owned_by": "surojax", "max_model_len": state.max_model_len}
    data = [{"id": state.model_name, **card, "root": state.model_path, "parent": None}]
    for name in sorted(lora.slots) if lora is not None else []:
        data.append({"id": name, **card, "root": lora.paths[name], "parent": state.model_name})
    return data


def model_card(cards: list[dict], model_id: str) -> dict:
    """GET /v1/models/{id}: the card of that id among `cards` (a 404 naming it and the served ids otherwise)."""
    for card in cards:
        if card["id"] == model_id:
            return card
    raise ApiError(404, unknown_model(model_id, [c["id"] for c in cards]), "invalid_request_error", "model")


def _message_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise ApiError(400, "only text content parts are supported", param="messages")
        return "".join(parts)
    raise ApiError(400, f"message content must be a string or a list of text parts, got {json_type(content)}",
                   param="messages")


def _check_role(message, index: int) -> None:
    """400 for a message without one of OpenAI's chat roles (a template would drop it silently, or fail)."""
    if (problem := role_problem(message)) is not None:
        raise ApiError(400, f"messages[{index}] {problem}", param="messages")


def _check_prompt(state: ServerState, ids: list[int], param: str) -> None:
    """`param` names the request field the prompt came from ("messages" for chat, "prompt" for completions)."""
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param)
    try:
        completion_budget(len(ids), None, state.max_model_len)
    except ContextLengthError as e:
        raise ApiError(400, str(e), param=param) from None
    vocab = state.engine.engine.model.cfg.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:  # C loops: a 512-token prompt's Python loop cost ~0.1 ms
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param=param)


def _params(state: ServerState, req, n_prompt: int, requested: int | None, logprobs: bool, top: int,
            tools: ToolChoice | None = None, prompt_logprobs: int | None = None):
    """tools: the chat request's tool_choice; "required" / a named function force the calls by a grammar, which
    excludes response_format / guided_* (either one grammar or the other; tools with "auto" parse the answer as
    calls, which a JSON answer is not). prompt_logprobs: the prompt is scored with this many alternatives
    (`serve.prompt_logprobs`); max_tokens may then be 0."""
    least = 0 if prompt_logprobs is not None else 1
    if requested is not None and requested < least:
        raise ApiError(400, f"max_tokens must be >= {least}, got {requested}", param="max_tokens")
    try:
        grammar = req.grammar()  # structured output: (field, grammar), checked here so a bad one is a 400
        if tools is not None and tools.parser is not None:
            if grammar is not None:
                raise SamplingParamsError(f"{grammar[0]} cannot be combined with tools (use tool_choice \"none\" "
                                          f"for structured output)", grammar[0])
            forced = tools.grammar(state.tokenizer.token_to_id)
            grammar = ("tools", forced) if forced is not None else None
        if grammar is not None:
            vocab = state.engine.engine.grammar_vocab
            if (err := vocab.check(grammar[1])) is not None:
                raise SamplingParamsError(f"{grammar[0]}: {err}", grammar[0])
            if (err := vocab.unwritable(grammar[1])) is not None:  # said now, not after a generation that fails
                field = "tool_choice" if grammar[0] == "tools" else grammar[0]  # the choice forces the call format
                raise SamplingParamsError(f"{field}: {err}", field)
        params = req.sampling_params(max_tokens=completion_budget(n_prompt, requested, state.max_model_len),
                                     eos_ids=state.eos_ids, logprobs=logprobs, top_logprobs=top,
                                     grammar=grammar[1] if grammar is not None else None,
                                     prompt_logprobs=prompt_logprobs)
        return params.validate(state.engine.engine.model.cfg.vocab_size)
    except SamplingParamsError as e:
        raise ApiError(400, str(e), param=e.param) from None


def _submit(state: ServerState, ids, params, adapter, split=False, images=None) -> Stream:
    """429 (queue full) or 503 (draining, engine gone), each with Retry-After, instead of a stream. images: the
    prompt's ImagePrompt (a chat request with image parts)."""
    try:
        return state.engine.submit(ids, params, adapter=adapter, split_reasoning=split, images=images)
    except Refused as e:
        full = isinstance(e, QueueFullError)
        raise ApiError(429 if full else 503, str(e), "rate_limit_error" if full else "server_error",
                       headers={"Retry-After": str(e.retry_after_s)}) from None


async def _wait_disconnect(raw: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next message is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _submit_n(state: ServerState, ids, params, adapter, n: int, split=False, images=None) -> list[Stream]:
    """n independent samples of one prompt: n engine requests (the later ones hit the first one's prefix blocks,
    published when it is scheduled); seeds seed, seed + 1, ... when the request gives one. All or none."""
    if n > 1 and n > state.engine.max_in_flight:  # could never all be in flight (n = 1: a full queue is a 429)
        raise ApiError(400, f"n = {n} is more than the server takes in flight ({state.engine.max_in_flight})",
                       param="n")
    streams: list[Stream] = []
    try:
        for j in range(n):
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + j)
            streams.append(_submit(state, ids, p, adapter, split, images))
    except ApiError:
        for s in streams:
            state.engine.abort(s)
        raise
    return streams


ABORTED = RequestStatus.FINISHED_ABORTED.value  # a request the engine ended early: not an OpenAI reason, never sent


def _for_client(item):
    """An engine output as the client may see it: an aborted one (`ABORTED`) becomes the ApiError that says why
    (400: its grammar cannot be continued by this vocabulary, its adapter was unloaded ...; 500 without a reason)."""
    if isinstance(item, BaseException) or not (item.finished and item.finish_reason == ABORTED):
        return item
    if item.error:
        return ApiError(400, item.error)
    return ApiError(500, "the engine ended the request early", "server_error")


async def _collect(stream: Stream, raw: Request):
    """All outputs of a non-streaming request; aborts it the moment the client disconnects."""
    outs = []
    gone = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        while True:
            item = asyncio.ensure_future(stream.queue.get())
            await asyncio.wait((item, gone), return_when=asyncio.FIRST_COMPLETED)
            if not item.done():
                item.cancel()
                gone.exception()  # a receive that failed counts as gone too (read here, so it is not logged unread)
                stream.owner.abort(stream)
                raise ClientGone()
            item = _for_client(item.result())
            if isinstance(item, ApiError):
                raise item
            if isinstance(item, BaseException):
                raise ApiError(500, str(item), "server_error")
            outs.append(item)
            if item.finished:
                return outs
    finally:
        gone.cancel()


async def _collect_all(state: ServerState, streams: list[Stream], raw: Request) -> list[list]:
    """`_collect` of every stream, in order; whatever is left unfinished (an error, a disconnect) is aborted."""
    try:
        return await asyncio.gather(*(_collect(s, raw) for s in streams))
    finally:
        for s in streams:
            if not s.finished:
                state.engine.abort(s)


def _ends(item) -> bool:
    return isinstance(item, BaseException) or item.finished


def _drain(q: asyncio.Queue, first) -> list:
    """``first`` and what else is already queued behind it, up to a stream's last item (`_for_client`'s)."""
    items = [_for_client(first)]
    while not _ends(items[-1]) and not q.empty():
        items.append(_for_client(q.get_nowait()))
    return items


async def _merged(streams: list[Stream]):
    """Batches of (choice index, output): everything that has arrived when the handler wakes up (an engine step
    delivers every stream's output at once; a slow client finds several queued), each stream's in order,
    streams by index. An engine error is raised after the outputs that came before it."""
    if len(streams) == 1:  # the common case: no futures, no asyncio.wait
        q = streams[0].queue
        while True:
            items = _drain(q, await q.get())
            if not isinstance(items[-1], BaseException):
                yield [(0, o) for o in items]
            elif len(items) > 1:
                yield [(0, o) for o in items[:-1]]
            if isinstance(items[-1], BaseException):
                raise items[-1]
            if items[-1].finished:
                return
    gets = {asyncio.ensure_future(s.queue.get()): i for i, s in enumerate(streams)}
    try:
        while gets:
            done, _ = await asyncio.wait(gets, return_when=asyncio.FIRST_COMPLETED)
            batch, error = [], None
            for fut in sorted(done, key=gets.__getitem__):
                i = gets.pop(fut)
                items = _drain(streams[i].queue, fut.result())
                if isinstance(items[-1], BaseException):
                    error = error or items.pop()
                elif not items[-1].finished:
                    gets[asyncio.ensure_future(streams[i].queue.get())] = i
                batch += [(i, o) for o in items]
            if batch:
                yield batch
            if error is not None:
                raise error
    finally:
        for fut in gets:
            fut.cancel()


# ---- the chat path: chat completions, and the Responses / Messages APIs converted onto it ---------------------

@dataclass
class ChatRun:
    """A chat request on the engine: its prompt ids, the streams of its n samples, its tool choice, and whether
    the reasoning is split from the content (`ServerState.thinking`)."""
    ids: list[int]
    streams: list[Stream]
    tools: ToolChoice
    split: bool


def chat_image_prompt(state: ServerState, req: ChatCompletionRequest) -> ImagePrompt:
    """A request whose messages carry image parts -> its ImagePrompt (serve/image_prompt.py: ids with the image
    tokens expanded, pixels, content hashes, M-RoPE positions); every problem a 400 naming it."""
    messages = []
    for i, m in enumerate(req.messages):
        _check_role(m, i)
        messages.append(dict(m))
    try:
        return prompt_with_images(messages, state.tokenizer, state.vision, tools=req.tools,
                                  template_kwargs=req.chat_template_kwargs or {},
                                  allow_remote=state.allow_remote_images)
    except ImagePromptError as e:
        raise ApiError(400, str(e), param="messages") from None


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[list[int], ToolChoice]:
    """The request's messages (roles checked, content as text) and tools through the chat template -> (prompt ids,
    checked against max-model-len and the vocabulary; the resolved tool choice). `chat_request_prompt` also
    gives the images."""
    ids, tools, _ = chat_request_prompt(state, req)
    return ids, tools


def chat_request_prompt(state: ServerState, req: ChatCompletionRequest
                        ) -> tuple[list[int], ToolChoice, ImagePrompt | None]:
    """`chat_prompt` and the request's images: messages with image parts are parsed by chat_image_prompt (ids with
    the image tokens expanded; the ImagePrompt goes to the engine with them), others rendered as text."""
    try:
        tools = resolve_tool_choice(req.tools, req.tool_choice, state.tool_parser, req.parallel_tool_calls)
    except ToolChoiceError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if messages_have_images(req.messages):
        image_prompt = chat_image_prompt(state, req)
        _check_prompt(state, image_prompt.ids, "messages")
        return image_prompt.ids, tools, image_prompt
    messages = []
    for i, m in enumerate(req.messages):
        _check_role(m, i)
        m = dict(m)
        m["content"] = _message_text(m.get("content"))
        messages.append(m)
    ids = _render_chat(state, messages, req.tools, req.chat_template_kwargs or {}, True)
    _check_prompt(state, ids, "messages")
    return ids, tools, None


def start_chat(state: ServerState, req: ChatCompletionRequest) -> ChatRun:
    """Queue a chat request's n samples (the adapter its "model" names; sampling, stop, structured output and
    forced tool calls in its SamplingParams)."""
    adapter = _resolve_model(state, req.model)
    if (req.model_extra or {}).get("prompt_logprobs") is not None:  # vLLM's extension: served on completions only
        raise ApiError(400, "prompt_logprobs is served on /v1/completions (prompt_logprobs, or echo with "
                       "logprobs), not on the chat endpoint", param="prompt_logprobs")
    ids, tools, images = chat_request_prompt(state, req)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params = _params(state, req, len(ids), req.requested_max_tokens(), req.logprobs, top, tools)
    split = state.thinking
    return ChatRun(ids, _submit_n(state, ids, params, adapter, req.n, split, images), tools, split)


@dataclass(frozen=True)
class ChatPath:
    """The chat path as the other APIs drive it (responses_api, anthropic_api): they convert their request into a
    ChatCompletionRequest and the engine's outputs into their own answer; the engine request is the same."""
    state: ServerState

    def prompt(self, req: ChatCompletionRequest) -> tuple[list[int], ToolChoice]:
        """The prompt `start` would queue (its "model" checked too), queued not."""
        _resolve_model(self.state, req.model)
        return chat_prompt(self.state, req)

    def start(self, req: ChatCompletionRequest) -> ChatRun:
        return start_chat(self.state, req)

    async def collect(self, run: ChatRun, raw: Request) -> list[list]:
        """Every output of each stream (an aborted request: its ApiError; a disconnect: ClientGone)."""
        return await _collect_all(self.state, run.streams, raw)

    def merged(self, run: ChatRun):
        """Batches of (choice index, output) as they arrive (`_merged`)."""
        return _merged(run.streams)

    def abort(self, run: ChatRun) -> None:
        """End what is unfinished of `run` (a stream that stopped early: the client left, an error)."""
        for s in run.streams:
            if not s.finished:
                self.state.engine.abort(s)

    def think_ids(self) -> tuple[int, int] | None:
        return self.state.engine.engine.think_ids()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_event(e: ApiError) -> str:
    return _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}})


class _SseChunks:
    """``_sse`` of one response's chunk objects, which differ only in their "choices": the fixed part is encoded
    once and each chunk's choices spliced in (the same text as ``_sse(dict(head, choices=choices))``)."""
    _MARK = "\x00choices\x00"

    def __init__(self, head: dict):
        pre, _, post = _sse(dict(head, choices=self._MARK)).partition(json.dumps(self._MARK, ensure_ascii=False))
        self.pre, self.post = pre, post

    def __call__(self, choices: list) -> str:
        return self.pre + json.dumps(choices, ensure_ascii=False) + self.post


def _token_text(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def _chat_logprobs(tok, ids: list[int], lps) -> dict:
    content = []
    for t, (lp, top) in zip(ids, lps):
        s = _token_text(tok, t)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": (ts := _token_text(tok, i)), "logprob": v, "bytes": list(ts.encode())}
                                         for i, v in top]})
    return {"content": content}


def tokenizer_info(tok, max_model_len: int) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's named special tokens (eos_token, bos_token and pad_token always
    present, None when it has none), its chat template, the served context length."""
    info: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": None, "bos_token": None,
                            "pad_token": None, **tok.special_tokens, "model_max_length": max_model_len}
    try:
        info["chat_template"] = tok.get_chat_template()
    except ChatTemplateError:  # none, or several and none the default
        pass
    return info


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


# ---- the app --------------------------------------------------------------------------------------------------

def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="surojax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    tok = state.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":  # loc holds a character offset, not a field: no param (as OpenAI)
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        # param: the request's field (loc[0]); deeper parts (list indices, pydantic's union tags) go to the message
        return error_response(400, f"{'.'.join(loc)}: {msg}" if loc else msg, param=loc[0] if loc else None)

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.exception_handler(ClientGone)
    async def _client_gone(_, e: ClientGone):
        return JSONResponse({}, status_code=499)

    def unauthorized(path: str):
        message = "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')"
        if anthropic_api.serves(path):
            return anthropic_api.error_response(ApiError(401, message, "authentication_error"))
        return error_response(401, message, "authentication_error")

    app.add_middleware(ApiKeyAuth, api_key=lambda: state.api_key, open_paths=OPEN_PATHS, reject=unauthorized)

    # outermost: a body over the limit is refused before authentication, parsing or any handler
    app.add_middleware(BodySizeLimit, max_bytes=state.max_request_bytes,
                       reject=lambda status, message: error_response(status, message))

    # -- plumbing endpoints ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not state.engine.alive or state.engine.draining:
            message = "the engine thread is not running" if not state.engine.alive else "the server is draining"
            return error_response(503, message, "server_error",
                                  headers={"Retry-After": str(state.engine.retry_after_s())})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.engine.metrics.render(state.engine.engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards(state)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card(model_cards(state), model_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            for i, m in enumerate(req.messages):
                _check_role(m, i)
            ids = _render_chat(state, [dict(m) for m in req.messages], None, {}, req.add_generation_prompt)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_info(tok, state.max_model_len)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        vocab = state.engine.engine.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    def _runtime_lora() -> tuple[Any, LoraRoot]:
        lora = state.engine.engine.lora
        if lora is None or state.lora_root is None:
            raise ApiError(403, "loading and unloading LoRA adapters at run time is off: start the server with "
                                "--enable-lora --allow-runtime-lora --lora-root DIR", "permission_error")
        return lora, state.lora_root

    @app.post("/v1/load_lora_adapter")
    async def load_lora(req: LoadLoRARequest):
        lora, root = _runtime_lora()
        if req.lora_name == state.model_name:
            raise ApiError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
        if req.lora_name in lora.slots:
            raise ApiError(400, f"a LoRA adapter named {req.lora_name!r} is already loaded", param="lora_name")
        try:
            folder = root.resolve(req.lora_path)
        except LoraPathRefused as e:
            raise ApiError(400, str(e), param="lora_path") from None
        try:
            await state.engine.call(lambda eng: eng.load_lora(req.lora_name, folder))
        except (ValueError, OSError) as e:  # the loader's messages quote the files: the log gets them, not the client
            log.warning("runtime LoRA load of %r (%s) failed: %s", req.lora_name, folder, e)
            raise ApiError(400, f"cannot load the LoRA adapter at lora_path {req.lora_path!r}: not a plain PEFT LoRA "
                                "adapter this model and --max-lora-rank / --max-loras accept (the server log says "
                                "why)", param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(req: UnloadLoRARequest):
        _runtime_lora()
        try:
            await state.engine.call(lambda eng: eng.unload_lora(req.lora_name))
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # -- chat completions --------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        run = start_chat(state, req)
        ids, streams, tools, split = run.ids, run.streams, run.tools, run.split
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or state.model_name
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(_chat_stream(state, streams, rid, created, name, len(ids), usage, split, tools))
        results = await _collect_all(state, streams, raw)
        choices = [_chat_choice(i, outs, split, tools, req.logprobs) for i, outs in enumerate(results)]
        n_out = sum(len(o.new_token_ids) for outs in results for o in outs)
        return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                "usage": _usage(len(ids), n_out)}

    def _chat_choice(index: int, outs: list, split: bool, tools: ToolChoice, logprobs: bool) -> dict:
        content = "".join(o.text for o in outs)
        finish = outs[-1].finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if split:
            message["reasoning_content"] = "".join(o.reasoning_text for o in outs) or None
        if tools.parser is not None:
            text, calls = tools.parser.parse(content)
            try:
                if finish != "length":  # a call cut by max_tokens comes back as text, finish_reason "length"
                    tools.check(calls)
            except ToolChoiceError as e:
                raise ApiError(400, str(e), param=e.param) from None
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        if logprobs:
            out_ids = [t for o in outs for t in o.new_token_ids]
            choice["logprobs"] = _chat_logprobs(tok, out_ids, [lp for o in outs for lp in (o.logprobs or [])])
        return choice

    async def _chat_stream(state, streams: list[Stream], rid, created, name, n_prompt, include_usage, split,
                           tools: ToolChoice):
        encode = _SseChunks({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name})

        def chunk(index, delta, finish=None, logprobs=None):
            return encode([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

        parsers = [ToolCallStream(tools.parser) if tools.parser is not None else None for _ in streams]
        n_out = 0
        parts: list[str] = []  # the chunks of one batch of outputs: sent together
        try:
            for i in range(len(streams)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for batch in _merged(streams):
                for i, o in batch:
                    n_out += len(o.new_token_ids)
                    deltas: list[dict] = []  # this output's deltas, in order; the finish reason goes on the last
                    first: dict[str, Any] = {}
                    if o.reasoning_text:
                        first["reasoning_content"] = o.reasoning_text
                    content, calls = o.text, []
                    if parsers[i] is not None:
                        got = parsers[i].add(o.text, final=o.finished)
                        content, calls = got.content, got.calls
                    if content:
                        first["content"] = content
                    lps = _chat_logprobs(tok, o.new_token_ids, o.logprobs) if o.logprobs else None
                    if first or lps:
                        deltas.append(first)
                    for k, call in calls:  # a complete call: its id and name, then its arguments
                        deltas.append({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                                       "function": {"name": call.function.name, "arguments": ""}}]})
                        deltas.append({"tool_calls": [{"index": k,
                                                       "function": {"arguments": call.function.arguments}}]})
                    finish = o.finish_reason if o.finished else None
                    if o.finished and parsers[i] is not None:
                        if finish != "length":
                            tools.check(parsers[i].calls)
                        finish = "tool_calls" if finish == "stop" and parsers[i].calls else finish
                    if finish and not deltas:
                        deltas.append({})
                    for j, delta in enumerate(deltas):
                        last = j == len(deltas) - 1
                        parts.append(chunk(i, delta, finish if last else None, lps if j == 0 else None))
                if parts:
                    yield "".join(parts)
                    parts.clear()
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                            "choices": [], "usage": _usage(n_prompt, n_out)})
        except ToolChoiceError as e:
            yield "".join(parts) + _sse({"error": {"message": str(e), "type": "invalid_request_error",
                                                   "param": "tool_choice", "code": 400}})
        except ApiError as e:  # the engine ended a request early (`_for_client`)
            yield "".join(parts) + _error_event(e)
        except Exception as e:  # engine failure mid-stream: an error event, then [DONE]
            yield "".join(parts) + _sse({"error": {"message": str(e), "type": "server_error", "param": None,
                                                   "code": 500}})
        finally:
            for s in streams:
                if not s.finished:
                    state.engine.abort(s)
        yield "data: [DONE]\n\n"

    # -- completions -------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        adapter = _resolve_model(state, req.model)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if req.max_tokens == 0 and not req.echo:  # as vLLM: 0 asks for the prompt alone (scored), which is echo's
            raise ApiError(400, "max_tokens must be >= 1 (0 only with echo: the prompt alone, with its logprobs)",
                           param="max_tokens")
        if req.stream and req.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs is not available when stream is true (use echo with logprobs)",
                           param="prompt_logprobs")
        prompts = req.prompts()
        if not prompts:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if req.stream and len(prompts) > 1:
            raise ApiError(400, "streaming supports one prompt per request", param="prompt")
        top, scored = req.logprobs or 0, req.prompt_scores()
        encoded = []
        for p in prompts:  # each a string or a list of ints (the request's validation made them so)
            ids = tok.encode(p) if isinstance(p, str) else p
            _check_prompt(state, ids, "prompt")
            echo = (p if isinstance(p, str) else tok.decode(ids)) if req.echo else ""
            encoded.append((ids, _params(state, req, len(ids), req.max_tokens, req.logprobs is not None, top,
                                         prompt_logprobs=scored), echo))
        streams: list[Stream] = []  # choice index = prompt index * n + sample index (as OpenAI)
        try:
            for ids, params, _ in encoded:
                streams.extend(_submit_n(state, ids, params, adapter, req.n))
        except ApiError:
            for s in streams:
                state.engine.abort(s)
            raise
        echoes = [e for _, _, e in encoded for _ in range(req.n)]
        prompt_ids = [ids for ids, _, _ in encoded for _ in range(req.n)]
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.model or state.model_name
        n_prompt = sum(len(ids) for ids, _, _ in encoded)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(_completion_stream(state, streams, echoes, prompt_ids, rid, created, name, n_prompt,
                                                  usage, req.logprobs))
        results = await _collect_all(state, streams, raw)
        choices, n_out = [], 0
        for i, (outs, echo, pids) in enumerate(zip(results, echoes, prompt_ids)):
            out_ids = [t for o in outs for t in o.new_token_ids]
            choice = {"index": i, "text": echo + "".join(o.text for o in outs), "logprobs": None,
                      "finish_reason": outs[-1].finish_reason}
            scores = outs[0].prompt_logprobs
            if req.logprobs is not None:
                out_lps = [lp for o in outs for lp in (o.logprobs or [])]
                choice["logprobs"] = legacy_logprobs(tok, pids + out_ids, scores + out_lps, n=req.logprobs) \
                    if req.echo else legacy_logprobs(tok, out_ids, out_lps, n=req.logprobs)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, pids, scores, req.prompt_logprobs)
            choices.append(choice)
            n_out += len(out_ids)
        return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": _usage(n_prompt, n_out)}

    async def _completion_stream(state, streams: list[Stream], echoes: list[str], prompt_ids: list[list[int]], rid,
                                 created, name, n_prompt, include_usage, top: int | None):
        """echo: the prompt comes with a choice's first output (its prompt logprobs are computed by then), as
        vLLM streams it; top: the request's logprobs (None: none); text_offset counts the token texts from the
        choice's start, as the whole response does."""
        encode = _SseChunks({"id": rid, "object": "text_completion", "created": created, "model": name})

        def chunk(index, text, logprobs=None, finish=None):
            return encode([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])

        n_out = 0
        offset = [None] * len(streams)  # each choice's next text_offset, as the whole response has it (None: unsent)
        try:
            async for batch in _merged(streams):
                parts = []
                for i, o in batch:
                    n_out += len(o.new_token_ids)
                    text, ids, entries = o.text, list(o.new_token_ids), list(o.logprobs or [])
                    if offset[i] is None:
                        offset[i] = 0
                        if echoes[i]:
                            text = echoes[i] + text
                            if top is not None:
                                ids, entries = prompt_ids[i] + ids, o.prompt_logprobs + entries
                    lps = legacy_logprobs(tok, ids, entries, offset[i], n=top) if top is not None and ids else None
                    if lps is not None:
                        offset[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                    if text or lps or o.finished:
                        parts.append(chunk(i, text, lps, o.finish_reason if o.finished else None))
                if parts:
                    yield "".join(parts)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                            "choices": [], "usage": _usage(n_prompt, n_out)})
        except ApiError as e:  # the engine ended a request early (`_for_client`)
            yield _error_event(e)
        except Exception as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})
        finally:
            for s in streams:
                if not s.finished:
                    state.engine.abort(s)
        yield "data: [DONE]\n\n"

    # -- the Responses and Anthropic Messages APIs: conversions onto the chat path ------------------------------
    responses_api.register(app, ChatPath(state))
    anthropic_api.register(app, ChatPath(state))
    return app


def _render_chat(state: ServerState, messages, tools, kwargs: dict, add_generation_prompt: bool) -> list[int]:
    try:
        return state.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                   tools=tools, tokenize=True, **kwargs)
    except Exception as e:  # template errors (raise_exception, bad roles, missing variables) are the client's
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
