"""Live comparison with transformers itself (skipped where transformers is not installed, as in the main venv).

Run it from an environment with transformers, e.g. the reference one used by scripts/make_fixtures.py.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from surojax.data.tokenizer import Tokenizer  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOK_DIR = FIXTURES / "tokenizer"
LLAMA3 = (FIXTURES / "chat_templates" / "llama3_style.jinja").read_text()
CASES = json.loads((TOK_DIR / "expected_chat.json").read_text())["cases"]
GEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def pair(d: Path):
    return Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))


def hf_ids(hf, messages, **kw):
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


@pytest.mark.parametrize("template", [None, LLAMA3, GEN_TEMPLATE], ids=["chatml", "llama3", "generation"])
def test_chat_templates_equal_transformers(template):
    ours, hf = pair(TOK_DIR)
    for case in CASES:
        for agp in (False, True):
            kw = dict(add_generation_prompt=agp, tools=case.get("tools"), chat_template=template,
                      **case.get("kwargs", {}))
            try:
                want = hf_ids(hf, case["messages"], **kw)
            except Exception as e:  # noqa: BLE001
                with pytest.raises(Exception, match=str(e)[:40].replace("(", r"\(")):
                    ours.apply_chat_template(case["messages"], **kw)
                continue
            assert ours.apply_chat_template(case["messages"], **kw) == want, case["name"]


def test_assistant_mask_and_continue_final_message_equal_transformers():
    ours, hf = pair(TOK_DIR)
    for case in CASES:
        msgs = [m for m in case["messages"] if m["role"] in ("user", "assistant")]
        want = hf.apply_chat_template(msgs, chat_template=GEN_TEMPLATE, return_assistant_tokens_mask=True,
                                      return_dict=True)
        got = ours.apply_chat_template(msgs, chat_template=GEN_TEMPLATE, return_assistant_mask=True)
        assert got["input_ids"] == list(want["input_ids"]) and got["assistant_mask"] == list(want["assistant_masks"])
        if msgs[-1]["role"] == "assistant":
            for template in (None, LLAMA3):
                want = hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True,
                                              chat_template=template)
                got = ours.apply_chat_template(msgs, tokenize=False, continue_final_message=True,
                                               chat_template=template)
                assert got == want, case["name"]


def test_encode_decode_equal_transformers():
    ours, hf = pair(TOK_DIR)
    rng = random.Random(0)
    alphabet = "abcXYZ 019.,!?'\n\t\r-_<>|/éü東京🌞\u0301" + "".join(
        ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"])
    pieces = list(alphabet[:-50]) + ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>", "  ",
                                     "don't", " I'm"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                         hf.pad_token_id)
    assert ours.special_ids == set(hf.all_special_ids)


@pytest.mark.parametrize("variant", ["add_bos_eos", "bos_post_processor", "legacy_map", "jinja_file", "split_special"])
def test_config_variants_equal_transformers(tmp_path, variant):
    d = tmp_path / "tok"
    shutil.copytree(TOK_DIR, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    if variant == "add_bos_eos":  # ignored by transformers 5 (tokenizer.json's post-processor decides)
        cfg.update(add_bos_token=True, add_eos_token=True)
    elif variant == "legacy_map":
        for k in ("added_tokens_decoder", "eos_token", "bos_token", "pad_token", "additional_special_tokens"):
            cfg.pop(k)
        (d / "special_tokens_map.json").write_text(json.dumps(
            {"eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False,
                           "single_word": False}, "pad_token": "<|new_pad|>", "additional_special_tokens": ["<x>"]}))
    elif variant == "jinja_file":
        (d / "chat_template.jinja").write_text(LLAMA3)
    elif variant == "bos_post_processor":
        import tokenizers

        backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single="<|endoftext|> $A <|im_end|>", pair="<|endoftext|> $A $B",
            special_tokens=[("<|endoftext|>", 507), ("<|im_end|>", 509)])
        backend.save(str(d / "tokenizer.json"))
    elif variant == "split_special":
        cfg["split_special_tokens"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = pair(d)
    text = "<|im_start|>a<|new_pad|> b<x><|im_end|>"
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"]
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                         hf.pad_token_id)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(msgs) == hf_ids(hf, msgs)
