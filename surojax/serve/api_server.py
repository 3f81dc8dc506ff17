"""The OpenAI-compatible HTTP API (FastAPI) over one `AsyncEngine`.

    POST /v1/chat/completions   chat template from the tokenizer (tools passed to it), SSE streaming,
                                reasoning_content split at <think> tokens for thinking templates
    POST /v1/completions        text or token-id prompt(s)
    GET  /v1/models             the base model and every loaded LoRA adapter (pick one with "model")
    POST /v1/load_lora_adapter  {"lora_name", "lora_path"} (--enable-lora); /v1/unload_lora_adapter {"lora_name"}
    POST /tokenize, /detokenize; GET /health, /metrics (Prometheus text)

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``: 400 for bad JSON, unknown
model, prompt longer than max-model-len, invalid sampling values and invalid structured-output grammars
(response_format / guided_*: the schema or regex is compiled before the request is queued), 401 without the --api-key bearer token
(everything except /health and /metrics), 429 when the in-flight limit (max-num-seqs + max-queue) is reached,
503 when the engine thread is gone, 500 for anything unexpected — never a crash. A client that disconnects
(stream or not) aborts its request, which frees its KV blocks before the next engine step.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from surojax.generation.context import ContextLengthError, completion_budget
from surojax.generation.sampling import SamplingParamsError
from surojax.serve.async_engine import AsyncEngine, EngineDeadError, QueueFullError, Stream
from surojax.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRARequest,
                                    TokenizeRequest, UnloadLoRARequest)

OPEN_PATHS = ("/health", "/metrics")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


class ClientGone(Exception):
    pass


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    eos_ids: tuple[int, ...] = ()
    api_key: str | None = None
    model_path: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def thinking(self) -> bool:
        """The chat template has a <think> block and the tokenizer both think tokens: split reasoning."""
        try:
            template = self.tokenizer.get_chat_template()
        except Exception:
            return False
        return "<think>" in template and self.engine.engine.think_ids() is not None


# ---- helpers --------------------------------------------------------------------------------------------------

def _resolve_model(state: ServerState, name: str | None) -> str | None:
    """The request's "model" -> adapter name (None = base)."""
    if not name or name == state.model_name:
        return None
    lora = state.engine.engine.lora
    if lora is not None and name in lora.slots:
        return name
    known = [state.model_name] + (sorted(lora.slots) if lora is not None else [])
    raise ApiError(400, f"The model `{name}` does not exist (served: {', '.join(known)}).", "invalid_request_error",
                   "model")


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
    raise ApiError(400, f"message content must be a string or a list of text parts, got {type(content).__name__}",
                   param="messages")


def _check_prompt(state: ServerState, ids: list[int], param: str) -> None:
    """`param` names the request field the prompt came from ("messages" for chat, "prompt" for completions)."""
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param)
    try:
        completion_budget(len(ids), None, state.max_model_len)
    except ContextLengthError as e:
        raise ApiError(400, str(e), param=param) from None
    vocab = state.engine.engine.model.cfg.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param=param)


def _params(state: ServerState, req, n_prompt: int, requested: int | None, logprobs: bool, top: int):
    if requested is not None and requested < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {requested}", param="max_tokens")
    try:
        grammar = req.grammar()  # structured output: (field, grammar), checked here so a bad one is a 400
        if grammar is not None and (err := state.engine.engine.grammar_vocab.check(grammar[1])) is not None:
            raise SamplingParamsError(f"{grammar[0]}: {err}", grammar[0])
        params = req.sampling_params(max_tokens=completion_budget(n_prompt, requested, state.max_model_len),
                                     eos_ids=state.eos_ids, logprobs=logprobs, top_logprobs=top,
                                     grammar=grammar[1] if grammar is not None else None)
        return params.validate(state.engine.engine.model.cfg.vocab_size)
    except SamplingParamsError as e:
        raise ApiError(400, str(e), param=e.param) from None


def _submit(state: ServerState, ids, params, adapter, split=False) -> Stream:
    try:
        return state.engine.submit(ids, params, adapter=adapter, split_reasoning=split)
    except QueueFullError as e:
        raise ApiError(429, str(e), "rate_limit_error") from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error") from None


async def _collect(stream: Stream, raw: Request):
    """All outputs of a non-streaming request; aborts it if the client disconnects meanwhile."""
    outs = []
    while True:
        try:
            item = await asyncio.wait_for(stream.queue.get(), 0.5)
        except asyncio.TimeoutError:
            if await raw.is_disconnected():
                stream.owner.abort(stream)
                raise ClientGone() from None
            continue
        if isinstance(item, BaseException):
            raise ApiError(500, str(item), "server_error")
        outs.append(item)
        if item.finished:
            return outs


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


def _completion_logprobs(tok, ids: list[int], lps, offset0: int = 0) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = offset0
    for t, (lp, top) in zip(ids, lps):
        s = _token_text(tok, t)
        tokens.append(s)
        token_lps.append(lp)
        d: dict[str, float] = {}
        for i, v in top:  # tokens that decode to the same text keep the highest logprob
            d.setdefault(_token_text(tok, i), v)
        tops.append(d)
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """Qwen/Hermes-style <tool_call>{"name", "arguments"}</tool_call> blocks -> (remaining text, tool_calls)."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name = obj["name"]
        except (ValueError, KeyError, TypeError):
            continue
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if calls:
        text = _TOOL_CALL.sub("", text).strip()
    return text, calls


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


# ---- the app --------------------------------------------------------------------------------------------------

def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="surojax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    tok = state.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param)

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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_key and request.url.path not in OPEN_PATHS:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
                return error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                      "authentication_error")
        try:
            return await call_next(request)
        except ClientGone:
            return JSONResponse({}, status_code=499)

    # -- plumbing endpoints ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return error_response(503, "the engine thread is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.engine.metrics.render(state.engine.engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        lora = state.engine.engine.lora
        data = [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "surojax",
                 "root": state.model_path, "parent": None, "max_model_len": state.max_model_len}]
        for name in sorted(lora.slots) if lora is not None else []:
            data.append({"id": name, "object": "model", "created": state.created, "owned_by": "surojax",
                         "root": lora.paths[name], "parent": state.model_name, "max_model_len": state.max_model_len})
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            ids = _render_chat(state, [dict(m) for m in req.messages], None, {}, req.add_generation_prompt)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        vocab = state.engine.engine.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora(req: LoadLoRARequest):
        if state.engine.engine.lora is None:
            raise ApiError(400, "LoRA serving is off: start the server with --enable-lora")
        if req.lora_name == state.model_name:
            raise ApiError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
        try:
            await state.engine.call(lambda eng: eng.load_lora(req.lora_name, req.lora_path))
        except (ValueError, OSError) as e:
            raise ApiError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(req: UnloadLoRARequest):
        if state.engine.engine.lora is None:
            raise ApiError(400, "LoRA serving is off: start the server with --enable-lora")
        try:
            await state.engine.call(lambda eng: eng.unload_lora(req.lora_name))
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # -- chat completions --------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        adapter = _resolve_model(state, req.model)
        messages = []
        for m in req.messages:
            m = dict(m)
            if "role" not in m:
                raise ApiError(400, "every message needs a 'role'", param="messages")
            m["content"] = _message_text(m.get("content"))
            messages.append(m)
        ids = _render_chat(state, messages, req.tools, req.chat_template_kwargs or {}, True)
        _check_prompt(state, ids, "messages")
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = _params(state, req, len(ids), req.requested_max_tokens(), req.logprobs, top)
        split = state.thinking
        stream = _submit(state, ids, params, adapter, split)
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or state.model_name
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_chat_stream(state, stream, rid, created, name, len(ids), usage),
                                     media_type="text/event-stream")
        outs = await _collect(stream, raw)
        out_ids = [t for o in outs for t in o.new_token_ids]
        content = "".join(o.text for o in outs)
        reasoning = "".join(o.reasoning_text for o in outs)
        finish = outs[-1].finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if split:
            message["reasoning_content"] = reasoning or None
        if req.tools:
            message["content"], calls = _tool_calls(content)
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        if req.logprobs:
            choice["logprobs"] = _chat_logprobs(tok, out_ids, [lp for o in outs for lp in (o.logprobs or [])])
        return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": [choice],
                "usage": _usage(len(ids), len(out_ids))}

    async def _chat_stream(state, stream: Stream, rid, created, name, n_prompt, include_usage):
        def chunk(delta, finish=None, logprobs=None):
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

        n_out = 0
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for o in stream:
                n_out += len(o.new_token_ids)
                delta = {}
                if o.reasoning_text:
                    delta["reasoning_content"] = o.reasoning_text
                if o.text:
                    delta["content"] = o.text
                lps = _chat_logprobs(tok, o.new_token_ids, o.logprobs) if o.logprobs else None
                if delta or lps or o.finished:
                    yield chunk(delta, o.finish_reason if o.finished else None, lps)
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                            "choices": [], "usage": _usage(n_prompt, n_out)})
        except Exception as e:  # engine failure mid-stream: an error event, then [DONE]
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})
        finally:
            if not stream.finished:
                state.engine.abort(stream)
        yield "data: [DONE]\n\n"

    # -- completions -------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        adapter = _resolve_model(state, req.model)
        if req.echo or req.suffix:
            raise ApiError(400, "echo and suffix are not supported", param="echo" if req.echo else "suffix")
        prompts = req.prompts()
        if not prompts:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if req.stream and len(prompts) > 1:
            raise ApiError(400, "streaming supports one prompt per request", param="prompt")
        top = req.logprobs or 0
        encoded = []
        for p in prompts:
            if isinstance(p, list) and not all(isinstance(t, int) for t in p):
                raise ApiError(400, "a prompt is a string or a list of token ids", param="prompt")
            ids = tok.encode(p) if isinstance(p, str) else [int(t) for t in p]
            _check_prompt(state, ids, "prompt")
            encoded.append((ids, _params(state, req, len(ids), req.max_tokens, req.logprobs is not None, top)))
        streams = [_submit(state, ids, params, adapter) for ids, params in encoded]
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.model or state.model_name
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_completion_stream(state, streams[0], rid, created, name, len(encoded[0][0]),
                                                        usage, req.logprobs is not None),
                                     media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(_collect(s, raw) for s in streams))
        finally:
            for s in streams:
                if not s.finished:
                    state.engine.abort(s)
        choices, n_prompt, n_out = [], 0, 0
        for i, ((ids, _), outs) in enumerate(zip(encoded, results)):
            out_ids = [t for o in outs for t in o.new_token_ids]
            choice = {"index": i, "text": "".join(o.text for o in outs), "logprobs": None,
                      "finish_reason": outs[-1].finish_reason}
            if req.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(tok, out_ids, [lp for o in outs for lp in (o.logprobs or [])])
            choices.append(choice)
            n_prompt, n_out = n_prompt + len(ids), n_out + len(out_ids)
        return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": _usage(n_prompt, n_out)}

    async def _completion_stream(state, stream: Stream, rid, created, name, n_prompt, include_usage, want_lps):
        n_out = 0
        try:
            async for o in stream:
                n_out += len(o.new_token_ids)
                lps = _completion_logprobs(tok, o.new_token_ids, o.logprobs) if (want_lps and o.logprobs) else None
                if o.text or lps or o.finished:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                "choices": [{"index": 0, "text": o.text, "logprobs": lps,
                                             "finish_reason": o.finish_reason if o.finished else None}]})
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                            "choices": [], "usage": _usage(n_prompt, n_out)})
        except Exception as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})
        finally:
            if not stream.finished:
                state.engine.abort(stream)
        yield "data: [DONE]\n\n"

    return app


def _render_chat(state: ServerState, messages, tools, kwargs: dict, add_generation_prompt: bool) -> list[int]:
    try:
        return state.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                   tools=tools, tokenize=True, **kwargs)
    except Exception as e:  # template errors (raise_exception, bad roles, missing variables) are the client's
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
