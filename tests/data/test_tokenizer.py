"""Tokenizer + chat template against the golden transformers output in tests/fixtures (made by
scripts/make_fixtures.py), plus the loading variants and the errors."""
from __future__ import annotations

import json
import shutil
import unicodedata
from datetime import datetime
from pathlib import Path

import pytest

from surojax.data.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOK_DIR = FIXTURES / "tokenizer"
EXPECTED = json.loads((TOK_DIR / "expected_chat.json").read_text())
TEMPLATES = {"chatml": None, "llama3_style": (FIXTURES / "chat_templates" / "llama3_style.jinja").read_text()}
CASES = [(c, name) for c in EXPECTED["cases"] for name in c["expected"]]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TOK_DIR)


def copy_tokenizer(tmp_path: Path, **config_changes) -> Path:
    d = tmp_path / "tok"
    shutil.copytree(TOK_DIR, d)
    if config_changes:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        for k, v in config_changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


# -- golden parity ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,template", CASES, ids=[f"{c['name']}-{t}" for c, t in CASES])
def test_chat_template_matches_transformers(tok, case, template):
    expected = case["expected"][template]
    kw = dict(add_generation_prompt=case["add_generation_prompt"], tools=case.get("tools"),
              chat_template=TEMPLATES[template], **case.get("kwargs", {}))
    if "error" in expected:
        with pytest.raises(ChatTemplateError, match="rejected the conversation") as e:
            tok.apply_chat_template(case["messages"], **kw)
        assert expected["message"] in str(e.value)
        return
    assert tok.apply_chat_template(case["messages"], tokenize=False, **kw) == expected["text"]
    assert tok.apply_chat_template(case["messages"], tokenize=True, **kw) == expected["ids"]


def test_cases_cover_what_they_claim():
    names = {c["name"] for c in EXPECTED["cases"]}
    assert {"single_turn", "system_multi_turn", "unicode", "tools", "thinking"} <= names
    outcomes = [("error" in c["expected"][t], t) for c, t in CASES]
    assert (True, "llama3_style") in outcomes and (False, "llama3_style") in outcomes
    gen = {c["add_generation_prompt"] for c in EXPECTED["cases"]}
    assert gen == {True, False}


@pytest.mark.parametrize("sample", EXPECTED["encode_samples"], ids=lambda s: s["text"][:20])
def test_encode_matches_transformers(tok, sample):
    assert tok.encode(sample["text"]) == sample["ids"]


def test_special_tokens(tok):
    ids = EXPECTED["special_token_ids"]
    assert tok.vocab_size == len(tok) == EXPECTED["vocab_size"] == 512
    assert tok.bos_token_id == EXPECTED["bos_token_id"] == ids["<|endoftext|>"]
    assert tok.eos_token_id == EXPECTED["eos_token_id"] == ids["<|im_end|>"]  # given as an AddedToken dict
    assert tok.pad_token_id == EXPECTED["pad_token_id"]
    assert tok.special_ids == frozenset(ids.values())
    assert tok.encode("<think>") == [ids["<think>"]]  # special tokens are not split


# -- text <-> ids -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["Hello world!", "  two  spaces\n\nand lines\r\n", "東京 🌞 Grüße — x=1+2",
                                  "emoji 👩‍💻 zero\u200bwidth", "", "\x00\x01 control bytes \x7f"])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)  # the tokenizer normalizes to NFC


def test_decode_skips_special_tokens(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert tok.decode(ids) == "<|im_start|>user\nhi there<|im_end|>\n"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi there\n"


def test_add_special_tokens_follows_tokenizer_json_only(tmp_path, tok):
    import tokenizers

    plain = tok.encode("hello")
    assert tok.encode("hello", add_special_tokens=True) == plain  # the fixture's post-processor adds nothing
    # transformers 5 ignores tokenizer_config.json's add_bos_token when tokenizer.json exists; so do we.
    d = copy_tokenizer(tmp_path, add_bos_token=True, add_eos_token=True)
    assert Tokenizer.from_dir(d).encode("hello", add_special_tokens=True) == plain
    backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.bos_token_id)])
    backend.save(str(d / "tokenizer.json"))
    t = Tokenizer.from_dir(d)
    assert t.encode("hello", add_special_tokens=True) == [t.bos_token_id] + plain
    assert t.encode("hello") == plain


# -- chat template features -------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "Is 7 prime?"}, {"role": "assistant", "content": "Yes it is."},
        {"role": "user", "content": "And 9?"}, {"role": "assistant", "content": "No: 3 x 3."}]


def test_generation_blocks_give_the_assistant_mask(tok):
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
                "{% endfor %}")
    out = tok.apply_chat_template(MSGS, chat_template=template, return_assistant_mask=True)
    assert out["input_ids"] == tok.apply_chat_template(MSGS, chat_template=template)
    picked = [i for i, m in zip(out["input_ids"], out["assistant_mask"]) if m]
    assert tok.decode(picked) == "Yes it is.<|im_end|>No: 3 x 3.<|im_end|>"
    # Without generation blocks, nothing is marked.
    assert not any(tok.apply_chat_template(MSGS, return_assistant_mask=True)["assistant_mask"])


def test_continue_final_message(tok):
    msgs = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    text = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert text == "<|im_start|>user\nCount:<|im_end|>\n<|im_start|>assistant\n1, 2,"
    with pytest.raises(ChatTemplateError, match="cannot both"):
        tok.apply_chat_template(msgs, continue_final_message=True, add_generation_prompt=True)


def test_strftime_now_and_extra_variables(tok):
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, chat_template=TEMPLATES["llama3_style"], use_today=True)
    today = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {today}" in text
    # Keyword arguments override the special-token variables.
    text = tok.apply_chat_template(msgs, tokenize=False, chat_template=TEMPLATES["llama3_style"], bos_token="<B>")
    assert text.startswith("<B><|start_header_id|>")


def test_tojson_keeps_html_and_unicode(tok):
    t = "{{ messages[0].content | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=1) }}"
    text = tok.apply_chat_template([{"role": "user", "content": "<a> & 'é'"}], tokenize=False, chat_template=t)
    assert text == '"<a> & \'é\'"|{\n "b": 1,\n "a": [\n  1,\n  2\n ]\n}'


def test_sandbox_forbids_mutation(tok):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(MSGS, chat_template="{{ messages.append(1) }}")


# -- loading variants -------------------------------------------------------------------------------------------

def test_chat_template_jinja_file_wins(tmp_path):
    d = copy_tokenizer(tmp_path)
    (d / "chat_template.jinja").write_text(TEMPLATES["llama3_style"])
    t = Tokenizer.from_dir(d)
    case = next(c for c in EXPECTED["cases"] if c["name"] == "single_turn")
    assert t.apply_chat_template(case["messages"], add_generation_prompt=True) == \
        case["expected"]["llama3_style"]["ids"]


def test_named_templates(tmp_path, tok):
    chatml = tok.chat_template
    d = copy_tokenizer(tmp_path, chat_template=[{"name": "default", "template": chatml},
                                                {"name": "tool_use", "template": "TOOLS{{ tools | length if tools else 0 }}"}])
    t = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "x"}]
    assert t.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    assert t.apply_chat_template(msgs, tokenize=False, tools=[{"name": "f"}]) == "TOOLS1"
    assert t.apply_chat_template(msgs, tokenize=False, chat_template="tool_use") == "TOOLS0"

    d2 = copy_tokenizer(tmp_path / "2", chat_template=[{"name": "a", "template": "A"}, {"name": "b", "template": "B"}])
    with pytest.raises(ChatTemplateError, match=r"none is named 'default'.*\['a', 'b'\]"):
        Tokenizer.from_dir(d2).apply_chat_template(msgs)


def test_additional_chat_templates_dir(tmp_path):
    d = copy_tokenizer(tmp_path, chat_template=None)
    (d / "chat_template.jinja").write_text("DEFAULT")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "rag.jinja").write_text("RAG{{ documents | length }}")
    t = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "x"}]
    assert t.apply_chat_template(msgs, tokenize=False) == "DEFAULT"
    assert t.apply_chat_template(msgs, tokenize=False, chat_template="rag", documents=[{"text": "d"}]) == "RAG1"


def test_legacy_special_tokens_map_and_missing_specials_are_added(tmp_path):
    d = copy_tokenizer(tmp_path, added_tokens_decoder=None, eos_token=None, bos_token=None, pad_token=None,
                       additional_special_tokens=None)
    (d / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False,
                       "single_word": False}, "pad_token": "<|new_pad|>"}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token_id == EXPECTED["eos_token_id"]
    assert t.pad_token_id == 512 and t.vocab_size == 513  # a named special token missing from the vocab is added
    assert t.encode("a<|new_pad|>b")[1] == 512


# -- errors -----------------------------------------------------------------------------------------------------

def test_missing_directory_and_file(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_files_are_named(tmp_path):
    d = copy_tokenizer(tmp_path)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=f"cannot load {d / 'tokenizer.json'}"):
        Tokenizer.from_dir(d)
    d2 = copy_tokenizer(tmp_path / "2")
    (d2 / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=f"cannot read {d2 / 'tokenizer_config.json'}"):
        Tokenizer.from_dir(d2)


def test_no_chat_template(tmp_path):
    d = copy_tokenizer(tmp_path, chat_template=None)
    t = Tokenizer.from_dir(d)
    assert t.encode("hi") == Tokenizer.from_dir(TOK_DIR).encode("hi")  # everything else still works
    with pytest.raises(ChatTemplateError, match=f"tokenizer in {d} has no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_template_and_bad_input(tok):
    with pytest.raises(ChatTemplateError, match="does not compile.*line 1"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_trim_and_lstrip_blocks(tok):
    # transformers renders with trim_blocks and lstrip_blocks: block tags take their indentation and newline along.
    t = "A\n  {% if true %}\n  B\n  {% endif %}\nC{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
    t += "{{ m.content }}{% endfor %}"
    assert tok.apply_chat_template(MSGS, tokenize=False, chat_template=t) == "A\n  B\nCYes it is.And 9?No: 3 x 3."


def test_developer_role_is_system_unless_the_template_names_it(tok):
    """OpenAI's `developer` role (surojax/data/chat_roles.py): as `system` for a template that does not handle it,
    as itself for one that does (GPT-OSS's)."""
    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert tok.apply_chat_template(chat, chat_template=plain, tokenize=False) == "system: Be brief.\nuser: hi\n"
    knows = "{% for m in messages %}{{ '# ' if m.role == 'developer' else '' }}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert tok.apply_chat_template(chat, chat_template=knows, tokenize=False) == "# developer: Be brief.\nuser: hi\n"
