"""Pieces of the HTTP layer that need no server: tool-call parsing, chat rendering with tools, logprob shapes."""
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from surojax.data.tokenizer import Tokenizer  # noqa: E402
from surojax.serve.api_server import ApiError, ServerState, _render_chat  # noqa: E402
from surojax.serve.completion_logprobs import legacy_logprobs  # noqa: E402
from surojax.serve.tool_parsers import TOOL_PARSERS  # noqa: E402

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"


def test_tool_calls_are_parsed_out_of_the_text():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    rest, calls = TOOL_PARSERS["hermes"].parse(text)
    assert rest == "Sure."
    call = calls[0].to_openai()
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and call["type"] == "function"
    assert TOOL_PARSERS["hermes"].parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_chat_rendering_passes_tools_and_reports_template_errors():
    tok = Tokenizer.from_dir(FIXTURE)
    state = ServerState(engine=None, tokenizer=tok, model_name="m", max_model_len=128)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "1+2?"}]
    with_tools = tok.decode(_render_chat(state, msgs, tools, {}, True))
    assert '"name": "add"' in with_tools and "# Tools" in with_tools
    assert "# Tools" not in tok.decode(_render_chat(state, msgs, None, {}, True))
    with pytest.raises(ApiError, match="Unknown role"):
        _render_chat(state, [{"role": "wizard", "content": "x"}], None, {}, True)


def test_completion_logprobs_layout():
    tok = Tokenizer.from_dir(FIXTURE)
    ids = tok.encode("ab cd")
    lps = [(-0.5, [(t, -0.5), (t + 1, -1.0)]) for t in ids]
    out = legacy_logprobs(tok, ids, lps)
    assert out["tokens"] == [tok.decode([t]) for t in ids] and out["token_logprobs"] == [-0.5] * len(ids)
    assert out["text_offset"][0] == 0 and out["text_offset"][-1] == len("".join(out["tokens"][:-1]))
