"""Formats: exactly which token ids are supervised (fixture ChatML tokenizer), auto detection, truncation."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from surojax.data.chat_masks import ChatMaskError
from surojax.config.data import DatasetSpec
from surojax.data.formats import Example, detect_type, fit_length, make_formatter
from surojax.data.pipeline import DataStats, load_examples
from surojax.data.sources import DataError
from surojax.data.tokenizer import Tokenizer

FIX = Path(__file__).parents[1] / "fixtures"
SPEC = DatasetSpec(path="rows.jsonl")  # the default column names
IM_START, IM_END = 508, 509
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIX / "tokenizer")


@pytest.fixture(scope="module")
def plain_tok():
    t = Tokenizer.from_dir(FIX / "tokenizer")
    t.chat_template = None
    return t


def supervised(ex: Example) -> list[int]:
    return [int(i) for i, m in zip(ex.ids, ex.mask) if m]


def test_multi_turn_conversation_supervises_assistant_content_and_im_end_only(tok):
    ex = make_formatter("conversation", tok, SPEC)({"messages": CHAT})
    assert ex.ids.tolist() == tok.apply_chat_template(CHAT)  # the mask never changes the ids
    assert supervised(ex) == tok.encode("Hello!") + [IM_END] + tok.encode("4") + [IM_END]
    # Exactly where: right after each "<|im_start|>assistant\n" header, up to and including its <|im_end|>.
    header = tok.encode("<|im_start|>assistant\n")
    ids = ex.ids.tolist()
    starts = [t + len(header) for t in range(len(ids)) if ids[t:t + len(header)] == header]
    expected = np.zeros(len(ids), bool)
    for s, content in zip(starts, ("Hello!", "4")):
        expected[s:s + len(tok.encode(content)) + 1] = True
    np.testing.assert_array_equal(ex.mask, expected)
    assert ids[starts[0] + len(tok.encode("Hello!")) + 1] == tok.encode("\n")[0]  # the "\n" after <|im_end|>: no loss


def test_sharegpt_equals_openai_messages(tok):
    openai = make_formatter("conversation", tok, SPEC)({"messages": CHAT})
    row = json.loads((FIX / "data" / "sharegpt.jsonl").read_text().splitlines()[0])
    share = make_formatter("conversation", tok, SPEC)(row)
    np.testing.assert_array_equal(share.ids, openai.ids)
    np.testing.assert_array_equal(share.mask, openai.mask)


def test_train_on_inputs_supervises_everything(tok):
    ex = make_formatter("conversation", tok, SPEC, train_on_inputs=True)({"messages": CHAT})
    assert ex.mask.all()


def test_template_that_rewrites_earlier_turns_is_a_clear_error(tok):
    # The fixture template keeps <think> reasoning only after the last user turn: adding a user turn rewrites
    # the earlier assistant turn, so prefixes are not prefixes.
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye"}]
    with pytest.raises(ChatMaskError, match="prefix by prefix.*assistant message 1"):
        make_formatter("conversation", tok, SPEC)({"messages": msgs})
    # The last turn's reasoning is kept and supervised.
    ex = make_formatter("conversation", tok, SPEC)({"messages": msgs[:2]})
    assert tok.decode(supervised(ex)) == "<think>\ngreet back\n</think>\n\nHello<|im_end|>"


def test_other_template_without_special_end_token(tok):
    template = (FIX / "chat_templates" / "llama3_style.jinja").read_text()
    ex = make_formatter("conversation", tok, SPEC, chat_template=template)({"messages": CHAT[1:]})
    # <|eot_id|> is plain text in this vocab, so the whole turn (content + "<|eot_id|>") is supervised.
    assert tok.decode(supervised(ex)) == "Hello!<|eot_id|>4<|eot_id|>"


def test_instruction_through_the_chat_template(tok):
    row = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    ex = make_formatter("instruction", tok, SPEC)(row)
    expect = tok.apply_chat_template([{"role": "user", "content": "Add the numbers.\n\n2 and 3"},
                                      {"role": "assistant", "content": "5"}])
    assert ex.ids.tolist() == expect
    assert supervised(ex) == tok.encode("5") + [IM_END]


def test_instruction_without_a_chat_template_uses_the_alpaca_prompt(plain_tok):
    ex = make_formatter("instruction", plain_tok, SPEC)({"instruction": "Say hello.", "input": "", "output": "Hello!"})
    prompt = "### Instruction:\nSay hello.\n\n### Response:\n"
    assert ex.ids.tolist() == plain_tok.encode(prompt) + plain_tok.encode("Hello!") + [plain_tok.eos_token_id]
    assert supervised(ex) == plain_tok.encode("Hello!") + [plain_tok.eos_token_id]
    with pytest.raises(DataError, match="needs a chat template"):
        make_formatter("conversation", plain_tok, SPEC)


def test_text_appends_eos_and_supervises_all(tok):
    ex = make_formatter("text", tok, DatasetSpec(path="rows.jsonl", text_field="body"))({"body": "Hello world!"})
    assert ex.ids.tolist() == tok.encode("Hello world!") + [tok.eos_token_id]
    assert ex.mask.all()


@pytest.mark.parametrize("row,kind", [
    ({"messages": CHAT}, "conversation"), ({"conversations": []}, "conversation"),
    ({"instruction": "a", "input": "", "output": "b"}, "instruction"), ({"prompt": "a", "completion": "b"}, "instruction"),
    ({"text": "x", "meta": 1}, "text"), ({"prompt": "p", "chosen": "a", "rejected": "b"}, "preference")])
def test_auto_detection(row, kind):
    assert detect_type(row, SPEC)[0] == kind


def test_auto_logs_its_choice_and_unknown_columns_fail(tok, caplog):
    with caplog.at_level(logging.INFO, logger="surojax.data.pipeline"):
        out = load_examples(FIX / "data" / "alpaca.json", tok, sequence_len=256)
    assert len(out) == 3
    assert "type auto -> instruction (columns 'instruction' and 'output')" in caplog.text
    with pytest.raises(DataError, match="cannot tell the format from the columns \\['foo'\\]"):
        detect_type({"foo": 1}, SPEC)


def test_invalid_row_names_location_or_is_skipped(tok, tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]})
                 + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"chat\.jsonl:2: no assistant message"):
        load_examples(dict(path=str(p), type="conversation"), tok, sequence_len=256)
    stats = DataStats()
    out = load_examples(dict(path=str(p), type="conversation"), tok, sequence_len=256, skip_invalid_rows=True,
                        stats=stats)
    assert len(out) == 1 and stats.skipped_rows == 2
    assert stats.datasets[0]["skipped"] == 2
    robot = tmp_path / "robot.jsonl"
    robot.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"robot\.jsonl:1: message 0 has the unknown role 'robot' \(a message's role "
                                        r"is one of system, developer, user, assistant, tool\)"):
        load_examples(dict(path=str(robot), type="conversation"), tok, sequence_len=256)


@pytest.mark.parametrize("reader", ["pairs", "prompts"])
def test_dpo_pairs_and_grpo_prompts_name_or_skip_an_invalid_row(tok, tmp_path, reader):
    """The DPO pair and GRPO prompt readers share load_examples' row loop (pipeline.formatted_rows): an invalid
    row is an error naming file:line and skip_invalid_rows, or is skipped and counted."""
    from surojax.data.preference import load_pairs
    from surojax.data.prompts import load_prompts

    good = {"prompt": "2+2?", "chosen": "4", "rejected": "5"} if reader == "pairs" else {"prompt": "2+2?"}
    bad = {**good, "chosen": ""} if reader == "pairs" else {"prompt": ""}  # an empty answer / prompt: refused
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in (good, bad, good)) + "\n")
    spec = dict(path=str(p), type="preference" if reader == "pairs" else "prompt")

    def read(stats, skip):
        if reader == "pairs":
            return load_pairs(spec, tok, sequence_len=64, skip_invalid_rows=skip, stats=stats)
        return load_prompts([spec], tok, max_prompt_len=64, skip_invalid_rows=skip, stats=stats)

    with pytest.raises(DataError, match=r"rows\.jsonl:2: .*\(set skip_invalid_rows: true to skip such rows\)"):
        read(DataStats(), False)
    stats = DataStats()
    assert len(read(stats, True)) == 2 and stats.skipped_rows == 1 and stats.datasets[0]["skipped"] == 1


def test_truncation_and_drop_with_counts(tok, tmp_path):
    full = make_formatter("conversation", tok, SPEC)({"messages": CHAT})
    cut = fit_length(full, 20)
    assert len(cut) == 20 and cut.ids.tolist() == full.ids[:20].tolist()
    assert fit_length(full, 20, "drop") is None and fit_length(full, len(full)) is full
    short = make_formatter("conversation", tok, SPEC)({"messages": CHAT[:3]})
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT[:3]}) + "\n")
    stats = DataStats()
    out = load_examples(str(p), tok, sequence_len=len(short), stats=stats)
    assert (len(out), stats.truncated) == (2, 1)
    assert out[0].ids.tolist() == full.ids[:len(short)].tolist()
    stats = DataStats()
    out = load_examples(str(p), tok, sequence_len=len(short), truncation="drop", stats=stats)
    assert (len(out), stats.dropped_too_long) == (1, 1)
    n_prompt = len(tok.apply_chat_template(CHAT[:2], add_generation_prompt=True))
    stats = DataStats()  # only the first prompt fits: nothing left to learn, dropped and counted
    out = load_examples(str(p), tok, sequence_len=n_prompt, stats=stats)
    assert (len(out), stats.dropped_unsupervised, stats.truncated) == (0, 2, 2)


def test_preference_columns_follow_the_dataset_spec():
    spec = DatasetSpec(path="rows.jsonl", chosen_field="good", rejected_field="bad")
    assert detect_type({"prompt": "p", "good": "a", "bad": "b"}, spec) == ("preference", "columns 'good' and 'bad'")
    with pytest.raises(DataError, match="cannot tell"):
        detect_type({"prompt": "p", "good": "a", "bad": "b"}, SPEC)


def test_a_dataset_entry_is_validated_as_the_config_validates_it(tok):
    with pytest.raises(ValueError, match="txt_field"):  # pydantic's ValidationError is a ValueError
        load_examples({"path": str(FIX / "data" / "alpaca.json"), "txt_field": "body"}, tok, sequence_len=256)
