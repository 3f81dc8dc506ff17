"""Tools and the rest of the OpenAI surface: tool-call parsers (hermes / llama3_json / mistral, streamed = whole),
tool_choice, n > 1, echo, stop strings across token boundaries, seed — the parsers alone, the rest through the
official `openai` client against a live server (qwen3 fixture, fp32 on CPU).

The fixture's weights are random, so a test that needs a given answer scripts it: `scripted` wraps the runner's
`execute` so each request's next sampled token is the next token of a fixed text (then EOS); the scheduler,
detokeniser, stop strings, parsers and SSE all run as in production.
"""
import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time

import pytest

from surojax.serve.tool_parsers import (TOOL_PARSERS, ToolCallStream, ToolChoiceError, parser_for,
                                        resolve_tool_choice)

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from surojax.cli.main import build_parser, load_command  # noqa: E402
from surojax.cli.serve import serve_config  # noqa: E402
from surojax.serve.config import RunnerBuckets  # noqa: E402
from surojax.serve.launch import build_server  # noqa: E402
from tests.serve.test_server import FIXTURE, KEY, NAME, tok  # noqa: E402,F401

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CALL_TEXT = {
    "hermes": 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
              '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                   '{"name": "add", "parameters": {"a": 3, "b": 4}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
               '{"name": "add", "arguments": {"a": 3, "b": 4}}]',
}
NOT_A_CALL = {"hermes": "Sure <tool_call>not json</tool_call> ok", "llama3_json": '{"answer": 3}',
              "mistral": "[1, 2] are the numbers"}


# ---- the parsers, no server -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_parser_reads_its_format_and_streaming_equals_the_whole(fmt):
    parser = TOOL_PARSERS[fmt]
    content, calls = parser.parse(CALL_TEXT[fmt])
    assert content == ("Let me add." if fmt == "hermes" else "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}),
                                                                                  ("add", {"a": 3, "b": 4})]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2
    assert parser.parse(NOT_A_CALL[fmt]) == (NOT_A_CALL[fmt], [])
    # the marker token is dropped by skip_special_tokens: the bare JSON is still a call
    marker = {"llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}.get(fmt)
    if marker:
        assert len(parser.parse(CALL_TEXT[fmt].replace(marker, ""))[1]) == 2
    for text in (CALL_TEXT[fmt], NOT_A_CALL[fmt]):
        want_content, want_calls = parser.parse(text)
        for step in (1, 3, 7):  # every way of cutting the text into deltas gives the same answer
            stream = ToolCallStream(parser)
            pieces = [stream.add(text[i:i + step]) for i in range(0, len(text), step)] + [stream.add("", final=True)]
            assert "".join(p.content for p in pieces) == want_content
            got = [c for p in pieces for c in p.calls]
            assert [k for k, _ in got] == list(range(len(want_calls)))
            assert [c.function for _, c in got] == [c.function for c in want_calls]


def test_parser_choice_and_tool_choice_rules():
    assert parser_for("... <tool_call> ...", "llama").name == "hermes"  # the template's format wins
    assert parser_for(None, "llama").name == "llama3_json" and parser_for("", "mixtral").name == "mistral"
    assert parser_for("{{ messages }}", "gpt_oss") is None
    hermes = TOOL_PARSERS["hermes"]
    assert resolve_tool_choice([ADD], None, hermes).parser is hermes  # tools given: "auto"
    assert resolve_tool_choice([ADD], "none", hermes).parser is None
    named = resolve_tool_choice([ADD], {"type": "function", "function": {"name": "add"}}, hermes)
    assert named.required and named.function == "add"
    for tools, choice in (([ADD], "always"), ([ADD], {"type": "function", "function": {"name": "sub"}}),
                          (None, "required")):
        with pytest.raises(ToolChoiceError):
            resolve_tool_choice(tools, choice, hermes)
    with pytest.raises(ToolChoiceError, match="no tool-call format"):
        resolve_tool_choice([ADD], "required", None)
    with pytest.raises(ToolChoiceError, match="without one"):
        resolve_tool_choice([ADD], "required", hermes).check([])


# ---- through the server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = build_parser("serve", load_command("serve")).parse_args(
        ["serve", str(FIXTURE), "--served-model-name", NAME, "--api-key", KEY, "--max-num-seqs", "8",
         "--block-size", "4", "--num-kv-blocks", "512", "--max-model-len", "512", "--max-num-batched-tokens", "512"])
    config = serve_config(args)
    buckets = RunnerBuckets(min_rows=8, min_prefill_rows=8, min_context=512, min_prefill=512)  # few CPU compiles
    app, state = build_server(dataclasses.replace(config, engine=dataclasses.replace(config.engine, buckets=buckets)))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(10)
    state.engine.shutdown()


@contextlib.contextmanager
def scripted(state, tok, text):
    """Every request answers `text` (token by token), then EOS."""
    engine = state.engine.engine
    script, eos, real = tok.encode(text), state.eos_ids[0], engine.runner.execute

    def execute(scheduled, *rest):
        out = real(scheduled, *rest)
        for rid in list(out):
            k = len(engine.scheduler.requests[rid].output_token_ids)
            out[rid] = script[k] if k < len(script) else eos
        return out

    engine.runner.execute = execute
    try:
        yield
    finally:
        engine.runner.execute = real


ASK = [{"role": "user", "content": "1+2?"}]
SUB = {"type": "function", "function": {"name": "sub"}}


def together(url, *requests):
    """Send requests at once (one decode batch): each is fn(AsyncOpenAI) -> awaitable; streams are read to the
    end; an API error is returned, not raised."""
    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

        async def one(fn):
            r = await fn(c)
            return [x async for x in r] if isinstance(r, openai.AsyncStream) else r

        try:
            return await asyncio.gather(*(one(fn) for fn in requests), return_exceptions=True)
        finally:
            await c.close()

    return asyncio.run(run())


def test_tool_call_comes_back_as_tool_calls_streamed_or_not(server, tok):
    url, state = server
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": {"b": 2}}</tool_call>'
    ask = dict(model=NAME, messages=ASK, tools=[ADD], temperature=0)
    named_sub = {"type": "function", "function": {"name": "sub"}}
    with scripted(state, tok, text):
        r, chunks, plain, refused = together(
            url, lambda c: c.chat.completions.create(**ask), lambda c: c.chat.completions.create(**ask, stream=True),
            lambda c: c.chat.completions.create(**ask, tool_choice="none"),
            lambda c: c.chat.completions.create(**{**ask, "tools": [ADD, SUB]}, tool_choice=named_sub))
    assert isinstance(refused, openai.BadRequestError) and "'sub'" in refused.message
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me add."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("function", "add", {"a": 1}), ("function", "add", {"b": 2})]
    assert all(c.id.startswith("call_") for c in m.tool_calls)
    # the stream: content deltas + per-call deltas (id and name, then arguments) that reassemble to the same calls
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(t.function.name, t.function.arguments)
                                                                    for t in m.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me add."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls


def test_stop_string_across_a_token_boundary_streamed_or_not(server, tok):
    url, state = server
    text = "Hello world, goodbye moon"
    ids = tok.encode(text)
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    stop = "lo wor"  # no token holds it whole
    assert not any(stop in tok.decode([t]) for t in ids) and stop in text
    with scripted(state, tok, text):
        r, streamed = together(url, lambda c: c.completions.create(model=NAME, prompt="x", max_tokens=40, stop=[stop]),
                               lambda c: c.completions.create(model=NAME, prompt="x", max_tokens=40, stop=[stop],
                                                              stream=True))
    assert pieces[-1] == text
    assert r.choices[0].text == "Hel" and r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == "Hel" and streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_seeds_and_streaming(server, tok):
    prompt, chat = "Once upon a time", [{"role": "user", "content": "Tell me"}]
    sample = dict(model=NAME, max_tokens=6, temperature=1.0)
    greedy, sampled = together(  # at most 8 sequences at a time: one batch bucket (few CPU compilations)
        server[0], lambda c: c.completions.create(model=NAME, prompt=prompt, n=3, max_tokens=6, temperature=0),
        lambda c: c.completions.create(**sample, prompt=prompt, n=3, seed=11))
    *singles, once, streamed = together(
        server[0], *[lambda c, j=j: c.completions.create(**sample, prompt=prompt, seed=11 + j) for j in range(3)],
        lambda c: c.chat.completions.create(**sample, messages=chat, n=2, seed=5),
        lambda c: c.chat.completions.create(**sample, messages=chat, n=2, seed=5, stream=True))
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 18 and greedy.usage.prompt_tokens == len(tok.encode(prompt))
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) > 1  # independent samples
    # seeds seed, seed + 1, ...: choice j is the single request with seed 11 + j (same seed, same text)
    assert texts == [r.choices[0].text for r in singles]
    pieces = {0: "", 1: ""}
    for c in streamed:
        if c.choices:
            pieces[c.choices[0].index] += c.choices[0].delta.content or ""
    assert pieces == {c.index: c.message.content for c in once.choices} and pieces[0] != pieces[1]


def test_echo_returns_the_prompt(server, tok):
    prompt = "The quick brown fox"
    greedy = dict(model=NAME, max_tokens=5, temperature=0)
    plain, echoed, streamed, both = together(
        server[0], lambda c: c.completions.create(**greedy, prompt=prompt),
        lambda c: c.completions.create(**greedy, prompt=prompt, echo=True),
        lambda c: c.completions.create(**greedy, prompt=tok.encode(prompt), echo=True, stream=True),
        lambda c: c.completions.create(**greedy, prompt=prompt, echo=True, logprobs=1))
    assert plain.choices[0].text and echoed.choices[0].text == prompt + plain.choices[0].text
    assert "".join(c.choices[0].text for c in streamed) == prompt + plain.choices[0].text
    assert isinstance(both, openai.BadRequestError) and both.param == "echo"  # no prompt logprobs (yet)
