"""Several models behind one HTTP server: each model is the single-model app of `api_server` over its own engine
(scheduler, KV pool, engine thread), and a router in front picks one per request.

    client -> BodySizeLimit -> ApiKeyAuth -> ModelRouter --(the request's model)--> that model's app
                                                  `------(the server's own paths)--> the front app

The router reads the request's "model": the JSON body's (chat, completions, responses, messages, tokenize ...),
else the query's ``?model=NAME`` (GET /tokenizer_info, GET /v1/responses/{id}, the LoRA endpoints), else the
first model (the default). A name is a model's served name or one of its LoRA adapters'; an unknown one is a 404
naming it and listing every served name (OpenAI's error shape; Anthropic's on /v1/messages), before any model
sees it. The body (already read whole by `BodySizeLimit`) is handed on unchanged.

The front app serves what spans the models:
    GET  /health                 ok when every model's engine runs (else 503 naming the model)
    GET  /metrics                every model's metrics, each sample labelled model_name="NAME" (as vLLM labels
                                 them), plus surojax_model_sleeping per model
    GET  /v1/models              every model and its adapters; GET /v1/models/{id} one of them
    POST /sleep?level=1[&model=NAME], POST /wake_up[?model=NAME], GET /is_sleeping[?model=NAME]
                                 vLLM's sleep-mode endpoints (`serve.sleep`), with enable_sleep_mode (else 403);
                                 without model=, /sleep and /wake_up act on every model and /is_sleeping answers
                                 whether all sleep, with each model's state under "models". A model with requests
                                 in flight is not put to sleep (409). A request routed to a sleeping model wakes it
                                 (on its engine thread; the request waits meanwhile).

Idle sleep: a model with sleep_after_idle_s sleeps once it has had no request in flight, admitted or finished for
that long (`IdleSleeper`, polled on the event loop; the sleep itself runs on the engine thread, which refuses it if
a request got there first).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from surojax.serve import anthropic_api
from surojax.serve.api_error import ApiError
from surojax.serve.api_key import ApiKeyAuth
from surojax.serve.api_server import (OPEN_PATHS, ServerState, error_response, model_card, model_cards,
                                      served_names, unknown_model)
from surojax.serve.body_limit import BodySizeLimit
from surojax.serve.engine import EngineBusyError

log = logging.getLogger(__name__)
FRONT_PATHS = ("/health", "/metrics", "/v1/models", "/sleep", "/wake_up", "/is_sleeping")


@dataclass
class RoutedModel:
    """One served model: its server state (engine, tokenizer, name) and app; sleep_after_idle_s (None: never)."""

    state: ServerState
    app: ASGIApp
    sleep_after_idle_s: float | None = None

    @property
    def name(self) -> str:
        return self.state.model_name

    def serves(self, name: str) -> bool:
        return name in served_names(self.state)


@dataclass
class ModelTable:
    """The served models, the first the default."""

    models: list[RoutedModel]
    enable_sleep_mode: bool = False
    by_name: dict[str, RoutedModel] = field(init=False)

    def __post_init__(self):
        self.by_name = {m.name: m for m in self.models}

    def find(self, name: str | None) -> RoutedModel:
        """The model serving `name` (its own or an adapter's; None: the default) or a 404 naming them all."""
        if not name:
            return self.models[0]
        for m in self.models:
            if m.serves(name):
                return m
        raise ApiError(404, unknown_model(name, [n for m in self.models for n in served_names(m.state)]),
                       param="model")

    def selected(self, name: str | None) -> list[RoutedModel]:
        """?model=NAME -> that model (a 404 for any other name); none -> every model."""
        if name is None:
            return list(self.models)
        if name not in self.by_name:
            raise ApiError(404, unknown_model(name, list(self.by_name)), param="model")
        return [self.by_name[name]]


def _query_model(scope: Scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model")
    return values[0] if values else None


def _body_model(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None  # the model's app answers bad JSON (400)
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


class ModelRouter:
    """ASGI: the server's own paths to `front`, every other request to the app of the model it names."""

    def __init__(self, app: ASGIApp, *, table: ModelTable):
        self.front, self.table = app, table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in FRONT_PATHS or scope["path"].startswith("/v1/models/"):
            return await self.front(scope, receive, send)
        body, more, messages = b"", True, []
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            target = self.table.find(_query_model(scope) or _body_model(body))
        except ApiError as e:
            reply = anthropic_api.error_response(e) if anthropic_api.serves(scope["path"]) else \
                error_response(e.status, e.message, e.type, e.param)
            return await reply(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await target.app(scope, replay, send)


class IdleSleeper:
    """Puts a model to sleep once it has been idle for its sleep_after_idle_s (see the module docstring)."""

    def __init__(self, model: RoutedModel, poll_s: float | None = None):
        self.model = model
        self.timeout = model.sleep_after_idle_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout / 4)

    def _activity(self) -> tuple:
        eng = self.model.state.engine
        return eng.num_in_flight, eng.metrics.prompt_tokens, sum(eng.metrics.requests.values()), eng.metrics.rejected

    async def run(self) -> None:
        aeng = self.model.state.engine
        last_busy, seen = time.monotonic(), self._activity()
        while True:
            await asyncio.sleep(self.poll_s)
            now, activity = time.monotonic(), self._activity()
            if activity != seen or activity[0] or aeng.engine.is_sleeping or not aeng.alive:
                last_busy, seen = now, activity
                continue
            if now - last_busy >= self.timeout:
                try:
                    if await aeng.call(lambda eng: eng.sleep()):
                        log.info("%s: asleep after %.0f s idle", self.model.name, now - last_busy)
                except EngineBusyError:  # a request reached the engine first
                    pass
                last_busy, seen = time.monotonic(), self._activity()


def labelled_metrics(texts: dict[str, str]) -> str:
    """Several Prometheus texts (model name -> text) as one: each family's HELP / TYPE once, then every model's
    samples with model_name="NAME" first among their labels."""
    families: dict[str, list[str]] = {}  # family -> its HELP / TYPE lines, then samples
    for name, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP "):
                family = line.split()[2]
                if family not in families:
                    families[family] = [line]
            elif line.startswith("# TYPE "):
                if len(families[family]) == 1:
                    families[family].append(line)
            elif line and family is not None:
                sample, value = line.rsplit(" ", 1)
                metric, brace, labels = sample.partition("{")
                labels = f'model_name="{name}"' + ("," + labels[:-1] if brace else "")
                families[family].append(f"{metric}{{{labels}}} {value}")
    return "\n".join(line for lines in families.values() for line in lines) + "\n"


def build_router_app(table: ModelTable, *, api_key: str | None, max_request_bytes: int) -> FastAPI:
    """The server: the front app with the router, authentication and the body limit around it."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        sleepers = [asyncio.create_task(IdleSleeper(m).run()) for m in table.models
                    if m.sleep_after_idle_s is not None]
        try:
            yield
        finally:
            for task in sleepers:
                task.cancel()

    app = FastAPI(title="surojax", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.models = table

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.get("/health")
    async def health():
        for m in table.models:
            if not m.state.engine.alive or m.state.engine.draining:
                return error_response(503, f"{m.name}: the engine thread is not running or draining", "server_error",
                                      headers={"Retry-After": str(m.state.engine.retry_after_s())})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        texts = {m.name: m.state.engine.metrics.render(m.state.engine.engine) for m in table.models}
        sleeping = [f'surojax_model_sleeping{{model_name="{m.name}"}} {int(m.state.engine.engine.is_sleeping)}'
                    for m in table.models]
        text = labelled_metrics(texts) + "\n".join(
            ["# HELP surojax_model_sleeping 1 while the model sleeps (weights on the host, no KV pool).",
             "# TYPE surojax_model_sleeping gauge", *sleeping]) + "\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def cards() -> list[dict]:
        return [card for m in table.models for card in model_cards(m.state)]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card(cards(), model_id)

    def _sleep_mode() -> None:
        if not table.enable_sleep_mode:
            raise ApiError(403, "sleep mode is off: set enable_sleep_mode: true in the serve config",
                           "permission_error")

    @app.post("/sleep")
    async def sleep(level: int = 1, model: str | None = None):
        _sleep_mode()
        if level != 1:
            raise ApiError(400, f"sleep level {level} is not supported: level 1 moves the weights to host memory "
                                "and frees the KV cache", param="level")
        for m in table.selected(model):
            try:
                await m.state.engine.call(lambda eng: eng.sleep(level))
            except EngineBusyError as e:
                raise ApiError(409, f"{m.name}: {e}", "conflict_error", "model") from None
        return JSONResponse({})

    @app.post("/wake_up")
    async def wake_up(model: str | None = None):
        _sleep_mode()
        for m in table.selected(model):
            await m.state.engine.call(lambda eng: eng.wake_up())
        return JSONResponse({})

    @app.get("/is_sleeping")
    async def is_sleeping(model: str | None = None):
        states = {m.name: m.state.engine.engine.is_sleeping for m in table.selected(model)}
        answer = {"is_sleeping": all(states.values())}
        if model is None and len(table.models) > 1:
            answer["models"] = states
        return answer

    app.add_middleware(ModelRouter, table=table)
    def unauthorized(path: str):
        e = ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                     "authentication_error")
        return anthropic_api.error_response(e) if anthropic_api.serves(path) else \
            error_response(e.status, e.message, e.type)

    app.add_middleware(ApiKeyAuth, api_key=lambda: api_key, open_paths=OPEN_PATHS, reject=unauthorized)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes,
                       reject=lambda status, message: error_response(status, message))
    return app


__all__ = ["FRONT_PATHS", "IdleSleeper", "ModelRouter", "ModelTable", "RoutedModel", "build_router_app",
           "labelled_metrics"]
