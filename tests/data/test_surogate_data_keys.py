"""The data keys surojax reads for Surogate's configs (docs/surogate_compat.md): a dataset's system_field, tools_field,
prompt_format(_no_input) and message_property_mappings, and the config's use_chat_template, template (a family name),
truncation_strategy and max_length. Each is checked against the rendering it must equal (fixture ChatML tokenizer)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from surojax.config.data import DatasetSpec
from surojax.data.formats import Example, fit_pieces, make_formatter
from surojax.data.pipeline import DataStats, load_examples
from surojax.data.sources import DataError
from surojax.data.tokenizer import Tokenizer

FIX = Path(__file__).parents[1] / "fixtures"
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIX / "tokenizer")


def same(a: Example, b: Example) -> bool:
    return np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)


def test_system_field_gives_each_row_its_system_prompt(tok):
    spec = DatasetSpec(path="x", system_field="sys", system_prompt="fallback")
    want = make_formatter("conversation", tok, DatasetSpec(path="x"))(
        {"messages": [{"role": "system", "content": "Row's own."}, *MESSAGES]})
    assert same(make_formatter("conversation", tok, spec)({"messages": MESSAGES, "sys": "Row's own."}), want)
    fallback = make_formatter("conversation", tok, DatasetSpec(path="x"))(
        {"messages": [{"role": "system", "content": "fallback"}, *MESSAGES]})
    assert same(make_formatter("conversation", tok, spec)({"messages": MESSAGES, "sys": ""}), fallback)
    inst = DatasetSpec(path="x", system_field="sys")
    row = {"instruction": "Add 1 and 2.", "output": "3", "sys": "Be exact."}
    as_chat = make_formatter("conversation", tok, DatasetSpec(path="x"))({"messages": [
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "3"}]})
    assert same(make_formatter("instruction", tok, inst)(row), as_chat)


def test_message_property_mappings_and_tools_field(tok):
    spec = DatasetSpec(path="x", message_property_mappings={"role": "speaker", "content": "text"},
                       tools_field="functions")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    row = {"messages": [{"speaker": "user", "text": "Hi"}, {"speaker": "assistant", "text": "Hello!"}],
           "functions": json.dumps(tools)}
    want = make_formatter("conversation", tok, DatasetSpec(path="x"))({"messages": MESSAGES, "tools": tools})
    assert same(make_formatter("conversation", tok, spec)(row), want)
    no_tools = make_formatter("conversation", tok, DatasetSpec(path="x", tools_field=None))(
        {"messages": MESSAGES, "tools": tools})
    assert not same(no_tools, want)  # tools_field: null reads no tools column


def test_prompt_format_writes_the_user_turn(tok):
    spec = DatasetSpec(path="x", prompt_format="Q: {instruction}\nContext: {input}",
                       prompt_format_no_input="Q: {instruction}")
    chat = make_formatter("conversation", tok, DatasetSpec(path="x"))
    for inp, user in (("a table", "Q: Sum?\nContext: a table"), ("", "Q: Sum?")):
        got = make_formatter("instruction", tok, spec)({"instruction": "Sum?", "input": inp, "output": "3"})
        assert same(got, chat({"messages": [{"role": "user", "content": user}, {"role": "assistant",
                                                                                 "content": "3"}]}))


def test_use_chat_template_false_renders_the_plain_prompt(tok):
    spec = DatasetSpec(path="x", prompt_format="Q: {instruction}\nA: ")
    ex = make_formatter("instruction", tok, spec, use_chat_template=False)(
        {"instruction": "Sum?", "input": "x", "output": "3"})
    prompt, out = tok.encode("Q: Sum?\nA: ", add_special_tokens=True), tok.encode("3") + [tok.eos_token_id]
    assert ex.ids.tolist() == prompt + out and ex.mask.tolist() == [False] * len(prompt) + [True] * len(out)
    with pytest.raises(DataError, match="use_chat_template is false"):
        make_formatter("conversation", tok, DatasetSpec(path="x"), use_chat_template=False)


def test_template_family_is_checked_against_the_tokenizers_template(tok):
    make_formatter("conversation", tok, DatasetSpec(path="x"), template_family="qwen")  # ChatML: <|im_start|>
    with pytest.raises(DataError, match="not a llama3 template"):
        make_formatter("conversation", tok, DatasetSpec(path="x"), template_family="llama3")


@pytest.mark.parametrize("mode,expected", [
    ("truncate", [list(range(0, 4))]), ("left", [list(range(6, 10))]), ("drop", []),
    ("split", [list(range(0, 4)), list(range(4, 8)), [8, 9]]),
])
def test_truncation_strategies(mode, expected):
    ex = Example.of(np.arange(10), np.ones(10, bool))
    assert [p.ids.tolist() for p in fit_pieces(ex, 4, mode)] == expected


def test_max_length_and_split_through_the_pipeline(tok, tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "one two three four five six seven eight nine ten " * 3}) + "\n")
    full = load_examples({"path": str(path), "type": "text"}, tok, sequence_len=1000)[0]
    stats = DataStats()
    pieces = load_examples({"path": str(path), "type": "text"}, tok, sequence_len=1000, max_length=16,
                           truncation="split", stats=stats)
    assert np.array_equal(np.concatenate([p.ids for p in pieces]), full.ids)
    assert [len(p) for p in pieces[:-1]] == [16] * (len(pieces) - 1) and stats.split == len(pieces) - 1
    kept = load_examples({"path": str(path), "type": "text"}, tok, sequence_len=1000, max_length=16,
                         truncation="left")
    assert kept[0].ids.tolist() == full.ids[-16:].tolist()
