"""A real `surojax serve` for the API tests: the CLI's own parser and `serve_config`, `build_server`, uvicorn on a free
local port in a thread. One implementation for every test module that talks to the server over HTTP.

    with live_server(["--served-model-name", "m", "--max-num-seqs", "8"], buckets=...) as (url, state):
        openai.OpenAI(base_url=url + "/v1", ...)
"""
from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from surojax.cli.main import build_parser, load_command
from surojax.cli.serve import serve_config
from surojax.serve.config import RunnerBuckets, ServeConfig
from surojax.serve.launch import build_server

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3"


def parse_serve_args(argv: list[str], model: Path | str = FIXTURE) -> ServeConfig:
    """`surojax serve MODEL ARGV...` as the CLI reads it (flags checked the same way)."""
    return serve_config(build_parser("serve", load_command("serve")).parse_args(["serve", str(model), *argv]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def live_server(argv: list[str], *, buckets: RunnerBuckets, model: Path | str = FIXTURE,
                backlog: int = 2048) -> Iterator[tuple[str, object]]:
    """Serve `model` with `argv` (the CLI's flags) and the runner's smallest shape `buckets` (few CPU compiles);
    yields (base URL, ServerState); stops the server and its engine thread afterwards."""
    config = parse_serve_args(argv, model)
    app, state = build_server(dataclasses.replace(config, engine=dataclasses.replace(config.engine, buckets=buckets)))
    try:
        with serving(app, backlog=backlog) as url:
            yield url, state
    finally:
        state.engine.shutdown()


@contextlib.contextmanager
def serving(app, *, backlog: int = 2048) -> Iterator[str]:
    """uvicorn serving `app` on a free local port in a thread -> its base URL; stopped afterwards."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", backlog=backlog))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)
