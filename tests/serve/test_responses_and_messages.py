"""The OpenAI Responses API (/v1/responses) and the Anthropic Messages API (/v1/messages) through the official
`openai` and `anthropic` clients against one live server (qwen3 fixture, fp32 on CPU): each answer equals the same
request through /v1/chat/completions (greedy: the same text and token counts), streamed or not; tool-call round
trips; reasoning; stop reasons; structured output; errors in each API's shape.

Answers that need a given text are scripted (`scripted`: the runner samples the script's tokens, then EOS); the
conversions, engine, parsers and SSE run as in production.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("uvicorn")

from surojax.serve.config import RunnerBuckets  # noqa: E402
from tests.serve.live_server import live_server  # noqa: E402
from tests.serve.test_server import KEY, NAME  # noqa: E402
from tests.serve.test_tools_and_choices import ADD, scripted  # noqa: E402

ADD_FLAT = {"type": "function", **ADD["function"]}  # the Responses API's flat function tool
ADD_ANTHROPIC = {"name": "add", "description": ADD["function"]["description"],
                 "input_schema": ADD["function"]["parameters"]}
SYSTEM, ASK = "Be brief.", "What is 1+2?"
CALL = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
GREEDY = {"temperature": 0}  # the anthropic client has no temperature argument any more: sent as an extra


@pytest.fixture(scope="module")
def server():
    # 512 tokens: the tiny tokenizer spells the template's tool list in ~400
    argv = ["--served-model-name", NAME, "--api-key", KEY, "--max-num-seqs", "8", "--block-size", "4",
            "--num-kv-blocks", "1024", "--max-model-len", "512", "--max-num-batched-tokens", "512"]
    buckets = RunnerBuckets(min_rows=8, min_prefill_rows=8, min_context=512, min_prefill=512)
    with live_server(argv, buckets=buckets) as served:
        yield served


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def ac(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0)


def chat(oc, messages, **kw):
    return oc.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)


def at_once(*calls):
    """The calls' results, the calls made at the same time (their requests decode in one batch)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def responses_stream(oc, **kw):
    """(the events, the final response) of the openai client's stream helper."""
    with oc.responses.stream(**kw) as s:
        return list(s), s.get_final_response()


def messages_stream(ac, **kw):
    """(the events, the final message) of the anthropic client's stream helper."""
    with ac.messages.stream(**kw) as s:
        return list(s), s.get_final_message()


def test_greedy_text_and_usage_equal_chat_completions_streamed_or_not(oc, ac):
    user = [{"role": "user", "content": ASK}]
    want, r, events, m, (_, final), counted = at_once(
        lambda: chat(oc, [{"role": "system", "content": SYSTEM}, *user], max_tokens=8),
        lambda: oc.responses.create(model=NAME, instructions=SYSTEM, input=ASK, max_output_tokens=8, temperature=0),
        lambda: list(oc.responses.create(model=NAME, instructions=SYSTEM, input=[
            {"role": "user", "content": [{"type": "input_text", "text": ASK}]}], max_output_tokens=8, temperature=0,
            stream=True)),
        lambda: ac.messages.create(model=NAME, system=SYSTEM, messages=user, max_tokens=8, extra_body=GREEDY),
        lambda: messages_stream(ac, model=NAME, system=[{"type": "text", "text": SYSTEM}], messages=[
            {"role": "user", "content": [{"type": "text", "text": ASK}]}], max_tokens=8, extra_body=GREEDY),
        lambda: ac.messages.count_tokens(model=NAME, system=SYSTEM, messages=user))
    counted_r = oc.responses.input_tokens.count(model=NAME, instructions=SYSTEM, input=ASK)
    text = want.choices[0].message.content
    assert want.choices[0].finish_reason == "length" and text
    assert r.object == "response" and r.output_text == text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.total_tokens)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == want.usage.completion_tokens

    assert m.type == "message" and m.role == "assistant" and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == text and m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == want.usage.completion_tokens
    assert counted.input_tokens == counted_r.input_tokens == want.usage.prompt_tokens
    assert counted_r.object == "response.input_tokens"


def test_responses_tool_call_round_trip(server, oc):
    url, state = server
    ask = dict(model=NAME, input=ASK, tools=[ADD_FLAT], temperature=0)
    with scripted(state, state.tokenizer, CALL):
        r, (events, final) = at_once(lambda: oc.responses.create(**ask), lambda: responses_stream(oc, **ask))
    message, call = r.output
    assert r.status == "completed" and message.type == "message" and message.content[0].text == "Let me add."
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"a": 1, "b": 2} and call.status == "completed"
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [("message", None), ("function_call", "add")]
    assert final.output[1].arguments == call.arguments and final.output_text == "Let me add."
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    # the round trip: the output items and the call's output as input = chat's assistant tool_calls + tool message;
    # after previous_response_id, the stored conversation goes first: the same prompt
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "3"}
    more = dict(tools=[ADD_FLAT], max_output_tokens=6, temperature=0)
    r2, r3, want = at_once(
        lambda: oc.responses.create(model=NAME, input=[{"role": "user", "content": ASK},
                                                       *[o.model_dump(exclude_none=True) for o in r.output], result],
                                    **more),
        lambda: oc.responses.create(model=NAME, previous_response_id=r.id, input=[result], **more),
        lambda: chat(oc, [{"role": "user", "content": ASK},
                          {"role": "assistant", "content": "Let me add.", "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": "add", "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "3"}], tools=[ADD], max_tokens=6))
    for got in (r2, r3):
        assert got.usage.input_tokens == want.usage.prompt_tokens
        assert got.output_text == want.choices[0].message.content
    assert oc.responses.retrieve(r3.id).output_text == r3.output_text


def test_messages_tool_call_round_trip(server, oc, ac):
    url, state = server
    ask = dict(model=NAME, messages=[{"role": "user", "content": ASK}], tools=[ADD_ANTHROPIC], max_tokens=100,
               extra_body=GREEDY)
    with scripted(state, state.tokenizer, CALL):
        m, (events, final) = at_once(lambda: ac.messages.create(**ask), lambda: messages_stream(ac, **ask))
    text, use = m.content
    assert m.stop_reason == "tool_use" and text.text == "Let me add."
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 1, "b": 2} and use.id.startswith("toolu_")
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == use.input
    assert "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta") == json.dumps(use.input)
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]
    m2, counted, want = at_once(
        lambda: ac.messages.create(model=NAME, messages=history, tools=[ADD_ANTHROPIC], max_tokens=6,
                                   extra_body=GREEDY),
        lambda: ac.messages.count_tokens(model=NAME, messages=history, tools=[ADD_ANTHROPIC]),
        lambda: chat(oc, [{"role": "user", "content": ASK},
                          {"role": "assistant", "content": "Let me add.", "tool_calls": [
                              {"id": use.id, "type": "function",
                               "function": {"name": "add", "arguments": json.dumps(use.input)}}]},
                          {"role": "tool", "tool_call_id": use.id, "content": "3"}], tools=[ADD], max_tokens=6))
    assert m2.usage.input_tokens == counted.input_tokens == want.usage.prompt_tokens
    assert "".join(b.text for b in m2.content if b.type == "text") == want.choices[0].message.content


def test_reasoning_and_stop_reasons(server, oc, ac):
    url, state = server
    tok = state.tokenizer
    script = "<think>\nplan it\n</think>\n\nThe answer. END more"
    n_reasoning = tok.encode(script).index(tok.token_to_id("</think>")) - 1  # tokens between the markers
    user = [{"role": "user", "content": ASK}]
    stop = dict(model=NAME, messages=user, max_tokens=100, stop_sequences=["END"], extra_body=GREEDY)
    with scripted(state, tok, script):
        want, r, (events, final), m, (anthropic_events, streamed) = at_once(
            lambda: chat(oc, user, max_tokens=100).choices[0].message,
            lambda: oc.responses.create(model=NAME, input=ASK, temperature=0),
            lambda: responses_stream(oc, model=NAME, input=ASK, temperature=0, store=False,
                                     include=["reasoning.encrypted_content"]),
            lambda: ac.messages.create(**stop), lambda: messages_stream(ac, **stop))
    assert want.reasoning_content.strip() == "plan it" and want.content == "The answer. END more"
    for resp in (r, final):
        assert [o.type for o in resp.output] == ["reasoning", "message"] and resp.status == "completed"
        assert resp.output[0].content[0].text == want.reasoning_content and resp.output_text == want.content
        assert resp.usage.output_tokens_details.reasoning_tokens == n_reasoning
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
    # include reasoning.encrypted_content: a stateless client hands the reasoning back as that blob (Codex-style);
    # it counts as the reasoning's text does where the template writes it (after the last user turn)
    blob = final.output[0].encrypted_content
    assert r.output[0].encrypted_content is None and blob
    call = [{"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "3"}]
    counts = [oc.responses.input_tokens.count(model=NAME, input=[{"role": "user", "content": ASK}, *thought, *call],
                                              tools=[ADD_FLAT]).input_tokens
              for thought in ([{"type": "reasoning", "summary": [], "encrypted_content": blob}],
                              [final.output[0].model_dump(exclude={"encrypted_content"})], [])]
    assert counts[0] == counts[1] > counts[2]
    for msg in (m, streamed):  # the stop sequence ends the text and is named
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
            ("thinking", want.reasoning_content), ("text", "The answer. ")]
        assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "END"
    assert "".join(e.delta.thinking for e in anthropic_events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == want.reasoning_content
    with scripted(state, tok, "Done."):
        m = ac.messages.create(**stop)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.content[0].text == "Done."
    # thinking switched off: the template's enable_thinking false, as chat_template_kwargs give it
    off, on, counted, r = at_once(
        lambda: chat(oc, user, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
        lambda: chat(oc, user, max_tokens=1),
        lambda: ac.messages.count_tokens(model=NAME, messages=user, thinking={"type": "disabled"}),
        lambda: oc.responses.create(model=NAME, input=ASK, reasoning={"effort": "none"}, max_output_tokens=1))
    assert off.usage.prompt_tokens != on.usage.prompt_tokens
    assert counted.input_tokens == r.usage.input_tokens == off.usage.prompt_tokens


def test_structured_output_in_both_apis(oc, ac):
    schema = {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["d"], "additionalProperties": False}
    r, m = at_once(
        lambda: oc.responses.create(model=NAME, input=ASK, max_output_tokens=40, temperature=0, text={
            "format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}}),
        lambda: ac.messages.create(model=NAME, messages=[{"role": "user", "content": ASK}], max_tokens=40,
                                   extra_body=GREEDY, output_config={"format": {"type": "json_schema", "schema": schema}}))
    jsonschema.validate(json.loads(r.output_text), schema)
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_errors_in_each_apis_shape(server, oc, ac):
    url, _ = server
    with pytest.raises(anthropic.BadRequestError) as e:  # the client requires max_tokens: the raw request lacks it
        ac.post("/v1/messages", body={"model": NAME, "messages": [{"role": "user", "content": ASK}]},
                cast_to=anthropic.types.Message)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:  # an image block reaches the chat path: a text model refuses
        ac.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert "cannot take images" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}])
    assert e.value.body["error"]["message"].startswith("messages[0].content[0].source must be")
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.create(model=NAME, input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}])
    assert e.value.param == "input" and "input[0].content[0].image_url" in e.value.message
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=NAME, messages=[{"role": "user", "content": ASK}])
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)  # the key as a bearer token works too
    assert bearer.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": ASK}]).input_tokens > 0

    for kwargs, param, said in (({"input": [{"type": "item_reference", "id": "x"}]}, "input", "input[0].type"),
                                ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
                                ({"input": ASK, "background": True}, "background", "background"),
                                ({"input": ASK, "include": ["file_search_call.results"]}, "include", "file_search"),
                                ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "%%"}]},
                                 "input", "input[0].encrypted_content"),
                                ({"input": ASK, "reasoning": {"summary": "detailed"}}, "reasoning.summary", "summar"),
                                ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
                                ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            oc.responses.create(**{"model": NAME, **kwargs})
        assert e.value.param == param and said in e.value.message, (kwargs, e.value.body)
    with pytest.raises(openai.NotFoundError) as e:  # an unknown model: 404, as OpenAI answers
        oc.responses.create(model="nope", input=ASK)
    assert e.value.param == "model" and "nope" in e.value.message
    unstored = oc.responses.create(model=NAME, input=ASK, max_output_tokens=1, store=False)
    for rid in ("resp_unknown", unstored.id):
        with pytest.raises(openai.NotFoundError) as e:
            oc.responses.create(model=NAME, input=ASK, previous_response_id=rid, max_output_tokens=1)
        assert e.value.param == "previous_response_id"
