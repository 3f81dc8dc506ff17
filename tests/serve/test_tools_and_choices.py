"""Tools and the rest of the OpenAI surface: tool-call parsers (hermes / llama3_json / mistral, streamed = whole),
tool_choice, n > 1, echo, stop strings across token boundaries, seed — the parsers alone, the rest through the
official `openai` client against a live server (qwen3 fixture, fp32 on CPU).

The fixture's weights are random, so a test that needs a given answer scripts it: `scripted` wraps the runner's
`execute` so each request's next sampled token is the next token of a fixed text (then EOS); the scheduler,
detokeniser, stop strings, parsers and SSE all run as in production. Forced calls (tool_choice "required" / named)
are not scripted: the grammar mask alone makes the random model write valid calls.
"""
import asyncio
import contextlib
import json
import re

import jsonschema
import pytest
import tokenizers

from tests.serve.live_server import live_server  # noqa: E402
from surojax.data.tokenizer import Tokenizer
from surojax.serve.guided import GrammarVocab
from surojax.serve.tool_parsers import (TOOL_PARSERS, ToolCallStream, ToolChoiceError, parser_for,
                                        resolve_tool_choice)

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from surojax.serve.config import RunnerBuckets  # noqa: E402
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
    with pytest.raises(ToolChoiceError) as e:  # a tool without a name: the `tools` field is wrong
        resolve_tool_choice([{"type": "function", "function": {"parameters": {}}}], "auto", hermes)
    assert e.value.param == "tools"


# ---- through the server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    # 1024 tokens: the tiny tokenizer spells the template's tool list in ~450 tokens
    argv = ["--served-model-name", NAME, "--api-key", KEY, "--max-num-seqs", "8", "--block-size", "4",
            "--num-kv-blocks", "1024", "--max-model-len", "1024", "--max-num-batched-tokens", "512"]
    buckets = RunnerBuckets(min_rows=8, min_prefill_rows=8, min_context=1024, min_prefill=512)  # few CPU compiles
    with live_server(argv, buckets=buckets) as served:
        yield served


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
    with scripted(state, tok, text):
        r, chunks, plain = together(
            url, lambda c: c.chat.completions.create(**ask), lambda c: c.chat.completions.create(**ask, stream=True),
            lambda c: c.chat.completions.create(**ask, tool_choice="none"))
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
    assert both.choices[0].text == echoed.choices[0].text  # prompt logprobs: tests/serve/test_prompt_logprobs.py
    assert len(both.choices[0].logprobs.tokens) == len(tok.encode(prompt)) + 5


# ---- forced calls: the grammar, then the random model through the server ----------------------------------------

DIGIT = {"type": "function", "function": {"name": "digit", "parameters": {
    "type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["d"],
    "additionalProperties": False}}}
FLAG = {"type": "function", "function": {"name": "flag", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (DIGIT, FLAG)}
NAMED_FLAG = {"type": "function", "function": {"name": "flag"}}
# each format's layout of the calls the grammar writes: [(name, arguments JSON)] -> text
LAYOUT = {
    "hermes": lambda calls: "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>'
                                      for n, a in calls),
    "llama3_json": lambda calls: "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls),
    "mistral": lambda calls: "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}'
                                                         for n, a in calls) + "]",
}


def _admits(vocab, grammar: str, ids: list[int]) -> bool:
    """The grammar takes every token of ``ids`` and may end after them."""
    m = vocab.matcher(grammar)
    return m.llm.consume_tokens(ids) and m.llm.is_accepting()


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_call_grammar_admits_valid_calls_only(fmt):
    """Each format's grammar, stepped token by token through llguidance on the fixture tokenizer: calls in the
    format's layout with arguments valid against the schema pass (and parse back to the same calls); a wrong name,
    arguments off the schema, text around the calls, or a second call where one is asked for do not. A marker the
    tokenizer holds as one special token is matched by its id, and its spelling in plain text is refused."""
    tokenizer = Tokenizer.from_dir(FIXTURE)
    vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)
    parser, layout = TOOL_PARSERS[fmt], LAYOUT[fmt]
    required = resolve_tool_choice([DIGIT, FLAG], "required", parser).grammar(tokenizer.token_to_id)
    named = resolve_tool_choice([DIGIT, FLAG], NAMED_FLAG, parser).grammar(tokenizer.token_to_id)
    two = [("digit", '{"d": 7}'), ("flag", '{"on": false}')]
    assert _admits(vocab, required, tokenizer.encode(layout(two)))
    assert [(c.function.name, c.function.arguments) for c in parser.parse(layout(two))[1]] == two
    assert _admits(vocab, named, tokenizer.encode(layout(two[1:])))
    one = resolve_tool_choice([DIGIT, FLAG], "required", parser, parallel=False).grammar(tokenizer.token_to_id)
    assert _admits(vocab, one, tokenizer.encode(layout(two[:1])))
    assert not _admits(vocab, one, tokenizer.encode(layout(two)))  # parallel_tool_calls false: one call
    for grammar, calls in ((required, [("mul", '{"d": 7}')]), (required, [("digit", '{"d": 12}')]),
                           (required, [("digit", '{"d": 7, "e": 1}')]), (required, [("flag", '{"on": 1}')]),
                           (required, [("digit", '{"d":7}')]), (named, [("digit", '{"d": 7}')]), (named, two)):
        assert not _admits(vocab, grammar, tokenizer.encode(layout(calls))), calls
    assert not _admits(vocab, required, tokenizer.encode("Sure. " + layout(two)))
    assert not _admits(vocab, required, [])  # "required": at least one call
    # the markers as single special tokens (Mistral's [TOOL_CALLS]; <tool_call> in Qwen's vocabulary)
    markers = parser.syntax.markers
    if markers:
        tokenizer.backend.add_special_tokens([tokenizers.AddedToken(m, special=True, normalized=False)
                                              for m in markers])
        vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)
        as_tokens = resolve_tool_choice([DIGIT, FLAG], "required", parser).grammar(tokenizer.token_to_id)
        text = layout(two)
        ids = tokenizer.encode(text)
        assert tokenizer.token_to_id(markers[0]) in ids and _admits(vocab, as_tokens, ids)
        spelled = [t for piece in re.split("(" + "|".join(map(re.escape, markers)) + ")", text) if piece
                   for t in (tokenizer.encode(piece[0]) + tokenizer.encode(piece[1:]) if piece in markers
                             else tokenizer.encode(piece))]
        assert not _admits(vocab, as_tokens, spelled)


def _calls_of(response, stream: bool) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments) of each call and the finish reason, from a response or its chunks (deltas joined)."""
    if not stream:
        choice = response.choices[0]
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], choice.finish_reason
    calls: dict[int, list[str]] = {}
    for chunk in response:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += d.function.name or ""
            call[1] += d.function.arguments or ""
    return [tuple(c) for c in calls.values()], response[-1].choices[0].finish_reason


def test_forced_tool_calls_from_the_random_model(server):
    """The random model, unscripted, answers "required" / a named function with calls whose arguments validate
    against their tool's schema (jsonschema, independent of the grammar engine) — greedy and sampled, streamed
    too — because the mask writes the format. Without tool_choice it writes no call (checked)."""
    url, _ = server
    ask = dict(model=NAME, messages=ASK, tools=[DIGIT, FLAG], seed=4)
    cases = [("required", 0.0, False, True), ("required", 1.0, False, True), ("required", 1.0, True, True),
             ("required", 1.0, False, False), (NAMED_FLAG, 0.0, False, True), (NAMED_FLAG, 1.0, True, True),
             ("auto", 1.0, False, True)]
    results = together(url, *[
        lambda c, choice=choice, t=t, stream=stream, parallel=parallel: c.chat.completions.create(
            **ask, tool_choice=choice, temperature=t, stream=stream, parallel_tool_calls=parallel,
            max_tokens=48 if choice == "auto" else 400) for choice, t, stream, parallel in cases])
    for (choice, t, stream, parallel), r in zip(cases, results):
        assert not isinstance(r, Exception), r
        calls, finish = _calls_of(r, stream)
        if choice == "auto":
            assert not calls and finish != "tool_calls"
            continue
        assert finish == "tool_calls" and calls, (choice, t, stream)
        if choice is NAMED_FLAG:
            assert [name for name, _ in calls] == ["flag"]
        if not parallel:
            assert len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_forced_tools_with_structured_output_or_a_bad_schema_are_400s(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ASK, tools=[DIGIT], tool_choice="required",
                                       max_tokens=4, response_format={"type": "json_object"})
    assert e.value.param == "response_format" and "tools" in e.value.message
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ASK, tools=[bad], tool_choice="required", max_tokens=4)
    assert e.value.param == "tools" and "objekt" in e.value.message


def test_forced_call_the_vocabulary_cannot_write_is_a_400_saying_why(server, tmp_path, monkeypatch):
    """A named tool_choice whose call format needs `{`, served with a `{`-less vocabulary's grammar view: a 400 on
    tool_choice that names the missing `{` when the request arrives (it was "the model answered without one")."""
    from tests.serve.test_structured_output import tokenizer_without

    url, state = server
    engine = state.engine.engine
    vocab = GrammarVocab(tokenizer_without("{", tmp_path / "no_brace"), engine.model.cfg.vocab_size)
    monkeypatch.setitem(engine.__dict__, "grammar_vocab", vocab)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ASK, tools=[DIGIT, FLAG], tool_choice=NAMED_FLAG,
                                       max_tokens=64)
    assert e.value.param == "tool_choice", e.value.body
    assert "vocabulary cannot write it" in e.value.message and "starts with '{'" in e.value.message, e.value.message
