"""Tools and the rest of the OpenAI surface: tool-call parsers (hermes / llama3_json / mistral, streamed = whole),
tool_choice, n > 1, echo, stop strings across token boundaries, seed — the parsers alone, the rest through the
official `openai` client against a live server (qwen3 fixture, fp32 on CPU).

The fixture's weights are random, so a test that needs a given answer scripts it: `scripted` wraps the runner's
`execute` so each request's next sampled token is the next token of a fixed text (then EOS); the scheduler,
detokeniser, stop strings, parsers and SSE all run as in production.
"""
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
from tests.serve.test_server import FIXTURE, KEY, NAME, base, reference, tok  # noqa: E402,F401

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


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@contextlib.contextmanager
def scripted(state, tok, text):
    """Every request answers `text` (token by token), then EOS."""
    engine = state.engine.engine
    script, eos, real = tok.encode(text), state.eos_ids[0], engine.runner.execute

    def execute(scheduled):
        out = real(scheduled)
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


def test_tool_call_comes_back_as_tool_calls_streamed_or_not(server, client, tok):
    _, state = server
    text = CALL_TEXT["hermes"]
    with scripted(state, tok, text):
        r = client.chat.completions.create(model=NAME, messages=ASK, tools=[ADD], temperature=0)
        chunks = list(client.chat.completions.create(model=NAME, messages=ASK, tools=[ADD], temperature=0,
                                                     stream=True))
        plain = client.chat.completions.create(model=NAME, messages=ASK, tools=[ADD], tool_choice="none",
                                               temperature=0)
        with pytest.raises(openai.BadRequestError, match="'sub'"):
            client.chat.completions.create(model=NAME, messages=ASK, tools=[ADD, SUB], temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "sub"}})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me add."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("function", "add", {"a": 1, "b": 2}), ("function", "add", {"a": 3, "b": 4})]
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


def test_stop_string_across_a_token_boundary_streamed_or_not(server, client, tok):
    _, state = server
    text = "Hello world, goodbye moon"
    ids = tok.encode(text)
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    stop = "lo wor"  # no token holds it whole
    assert not any(stop in tok.decode([t]) for t in ids) and stop in text
    with scripted(state, tok, text):
        r = client.completions.create(model=NAME, prompt="x", max_tokens=40, stop=[stop])
        streamed = list(client.completions.create(model=NAME, prompt="x", max_tokens=40, stop=[stop], stream=True))
    assert pieces[-1] == text
    assert r.choices[0].text == "Hel" and r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == "Hel" and streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_seeds_and_streaming(client, tok):
    prompt = "Once upon a time"
    greedy = client.completions.create(model=NAME, prompt=prompt, n=3, max_tokens=6, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 18 and greedy.usage.prompt_tokens == len(tok.encode(prompt))
    sampled = client.completions.create(model=NAME, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11)
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) > 1  # independent samples
    # seeds seed, seed + 1, ...: choice j is the single request with seed 11 + j; same seed, same text
    assert texts == [client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0,
                                               seed=11 + j).choices[0].text for j in range(3)]
    chat = [{"role": "user", "content": "Tell me"}]
    once = client.chat.completions.create(model=NAME, messages=chat, n=2, max_tokens=8, temperature=1.0, seed=5)
    streamed = {0: "", 1: ""}
    for c in client.chat.completions.create(model=NAME, messages=chat, n=2, max_tokens=8, temperature=1.0, seed=5,
                                            stream=True):
        streamed[c.choices[0].index] += c.choices[0].delta.content or ""
    assert streamed == {c.index: c.message.content for c in once.choices}


def test_echo_returns_the_prompt(client, base, tok):
    prompt = "The quick brown fox"
    want = reference(base, tok, tok.encode(prompt), 5)
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=5, temperature=0)
    assert r.choices[0].text == prompt + want
    streamed = client.completions.create(model=NAME, prompt=tok.encode(prompt), echo=True, max_tokens=5,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompt + want
    with pytest.raises(openai.BadRequestError) as both:
        client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=2)
    assert both.value.param == "echo"
