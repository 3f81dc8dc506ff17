"""`surojax generate`: greedy ids equal surojax's own generate and transformers' greedy tokens, --chat uses the
model folder's chat template, and a bad --model is one clean error line (exit 1, no traceback)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from surojax.generation.loop import eos_ids
from surojax.cli.main import main
from surojax.data.tokenizer import Tokenizer
from surojax.generation.loop import generate
from surojax.weights.hf_checkpoint import load_model

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "tests" / "fixtures" / "models" / "qwen3"
EXPECTED_CHAT = ROOT / "tests" / "fixtures" / "tokenizer" / "expected_chat.json"


def run_generate(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["generate", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def shown_ids(out: str) -> dict:
    lines = [x for x in out.splitlines() if x.startswith('{"prompt_ids"')]
    assert len(lines) == 1, out
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def qwen3():
    model = load_model(QWEN3)
    tok = Tokenizer.from_dir(QWEN3)
    return model, tok, eos_ids(QWEN3, tok, model.cfg)


def test_show_ids_equal_a_greedy_run(capsys, qwen3):
    model, tok, stops = qwen3
    # the prompt and length of ARGS below: the same prefill / decode programs as the model-reference tests
    rc, out, err = run_generate(capsys, "--model", str(QWEN3), "--prompt", "hello world", "--max-new-tokens", "6",
                                "--temperature", "0", "--show-ids")
    assert rc == 0, err
    ids = shown_ids(out)
    assert ids["prompt_ids"] == tok.encode("hello world")
    assert ids["new_ids"] == generate(model, [tok.encode("hello world")], 6, stop_ids=stops)[0]
    assert 1 <= len(ids["new_ids"]) <= 6
    assert out.splitlines()[0] == tok.decode([t for t in ids["new_ids"] if t not in stops], skip_special_tokens=True)
    assert "qwen3, float32]" in err and f"[{len(ids['new_ids'])} tokens in" in err


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "gpt_oss_mxfp4"])
def test_greedy_ids_equal_transformers(capsys, family):
    """The fixture's greedy prompt as text: the CLI's ids are transformers' greedy tokens (the dense family's first
    8; the MoE families' whole 32; gpt_oss through its published MXFP4 form, the bf16 form's greedy tokens are in
    tests/models/test_hf_parity.py)."""
    model = QWEN3.parent / family
    exp = np.load(model / "expected.npz")
    tok = Tokenizer.from_dir(model)
    text = tok.decode(exp["greedy_prompt"].tolist())
    assert tok.encode(text) == exp["greedy_prompt"].tolist()  # the text encodes back to the same prompt
    n = 8 if family == "qwen3" else 32
    rc, out, err = run_generate(capsys, "--model", str(model), "--prompt", text, "--max-new-tokens", str(n),
                                "--ignore-eos", "--show-ids")
    assert rc == 0, err
    ids = shown_ids(out)
    assert ids["prompt_ids"] == exp["greedy_prompt"].tolist()
    assert ids["new_ids"] == exp["greedy_tokens"][:n].tolist()


def test_chat_uses_the_template(capsys, qwen3):
    model, tok, stops = qwen3
    case = next(c for c in json.loads(EXPECTED_CHAT.read_text())["cases"] if c["name"] == "single_turn")
    question = case["messages"][0]["content"]
    rc, out, err = run_generate(capsys, "--model", str(QWEN3), "--prompt", question, "--chat", "--max-new-tokens", "4",
                                "--show-ids")
    assert rc == 0, err
    ids = shown_ids(out)
    assert ids["prompt_ids"] == case["expected"]["chatml"]["ids"]  # what transformers' apply_chat_template gives
    assert ids["new_ids"] == generate(model, [ids["prompt_ids"]], 4, stop_ids=stops)[0]

    rc, out, err = run_generate(capsys, "--model", str(QWEN3), "--prompt", question, "--chat", "--system",
                                "Be brief.", "--max-new-tokens", "1", "--show-ids")
    assert rc == 0, err
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    assert shown_ids(out)["prompt_ids"] == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=True)


def test_bfloat16_and_sampling_run(capsys):
    rc, out, err = run_generate(capsys, "--model", str(QWEN3), "--prompt", "hello", "--max-new-tokens", "3",
                                "--dtype", "bfloat16", "--temperature", "0.8", "--top-k", "5", "--seed", "3",
                                "--ignore-eos", "--show-ids")
    assert rc == 0, err
    ids = shown_ids(out)["new_ids"]
    assert len(ids) == 3 and all(0 <= t < 512 for t in ids) and "bfloat16]" in err


def test_repo_id_from_the_hf_cache(capsys, tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--tiny-org--tiny-qwen3" / "snapshots" / ("ab" * 20)
    shutil.copytree(QWEN3, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text(snap.name)  # the layout huggingface_hub writes
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache only (tests/test_hub.py fetches from a stand-in Hub)
    args = ("--prompt", "hello world", "--max-new-tokens", "6", "--show-ids")  # ARGS' shapes
    rc, out, err = run_generate(capsys, "--model", "tiny-org/tiny-qwen3", *args)
    assert rc == 0, err
    rc2, out2, _ = run_generate(capsys, "--model", str(QWEN3), *args)
    assert rc2 == 0 and shown_ids(out) == shown_ids(out2)


# ---- errors -------------------------------------------------------------------------------------------------------

def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [x for x in err.splitlines() if x.strip()]


def test_bad_model_in_a_subprocess_is_one_clean_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1", "COLUMNS": "60"}
    r = subprocess.run([sys.executable, "-m", "surojax.cli.main", "generate", "--model", "org/BAD", "--prompt", "hi"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr  # not wrapped at COLUMNS either
    assert "model 'org/BAD': offline" in lines[0] and str(tmp_path / "hub") in lines[0]
    assert r.stdout == ""


def broken_copy(tmp_path: Path, drop: str | None = None) -> Path:
    d = tmp_path / "model"
    shutil.copytree(QWEN3, d)
    if drop:
        (d / drop).unlink()
    return d


@pytest.mark.parametrize("case", ["no_config", "no_weights", "truncated", "no_tokenizer", "missing_path"])
def test_bad_model_folders_are_one_clean_line(case, tmp_path, capsys):
    if case == "no_config":
        d, want = broken_copy(tmp_path, "config.json"), "no config.json"
    elif case == "no_weights":
        d, want = broken_copy(tmp_path, "model.safetensors"), "no model.safetensors"
    elif case == "truncated":
        d = broken_copy(tmp_path)
        raw = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(raw[:-100])
        want = "truncated: tensor"
    elif case == "no_tokenizer":
        d, want = broken_copy(tmp_path, "tokenizer.json"), "tokenizer.json not found"
    else:
        d, want = tmp_path / "absent" / "model", "does not exist"
    rc, out, err = run_generate(capsys, "--model", str(d), "--prompt", "hi")
    assert rc == 1
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0] and str(d) in lines[0], err
    assert out == ""


def test_each_bad_option_has_its_own_line_before_the_model_loads(capsys, tmp_path):
    """Every bad flag: its own error line naming the flag, the value and the range (the model is not loaded: a
    missing one is not reported); --system without --chat is refused, not ignored."""
    absent = str(tmp_path / "absent")
    rc, out, err = run_generate(capsys, "--model", absent, "--prompt", "hi", "--temperature", "-1", "--top-p", "2",
                                "--max-new-tokens", "0", "--top-k", "-2", "--system", "Be brief.")
    assert rc == 1 and out == ""
    assert error_lines(err) == [
        "error: --max-new-tokens 0: must be at least 1",
        "error: --temperature -1: must be >= 0 (0 = greedy)",
        "error: --top-p 2: must be in (0, 1] (1 = off)",
        "error: --top-k -2: must be -1 or 0 (off) or positive",
        "error: --system: a system message goes through the chat template; add --chat (without it the prompt is "
        "encoded as plain text)"]
    rc, _, err = run_generate(capsys, "--model", absent, "--prompt", "hi", "--top-p", "0")
    assert rc == 1 and error_lines(err) == ["error: --top-p 0: must be in (0, 1] (1 = off)"]
    assert main(["generate", "--model", str(QWEN3)]) == 2  # --prompt missing: argparse usage error
    assert "--prompt" in capsys.readouterr().err


def test_prompt_longer_than_the_context_is_an_error_naming_both_lengths(capsys, qwen3):
    """The rule `serve` applies (surojax.generation.context): prompt + completion fit max_position_embeddings
    (256 in the fixture); the prompt must leave room for one new token."""
    _, tok, _ = qwen3
    prompt = "hello " * 300
    n = len(tok.encode(prompt))
    assert n >= 256
    rc, out, err = run_generate(capsys, "--model", str(QWEN3), "--prompt", prompt)
    assert rc == 1 and out == ""
    lines = error_lines(err)
    assert len(lines) == 1 and f"maximum context length is 256 tokens; the prompt has {n} tokens" in lines[0], err


def test_max_new_tokens_is_cut_to_the_room_left(capsys, qwen3):
    _, tok, _ = qwen3
    prompt = "x " * 125
    n = len(tok.encode(prompt))
    assert 192 < n < 256  # room for fewer than 64 new tokens
    rc, out, err = run_generate(capsys, "--model", str(QWEN3), "--prompt", prompt, "--max-new-tokens", "64",
                                "--ignore-eos", "--show-ids")
    assert rc == 0, err
    assert len(shown_ids(out)["new_ids"]) == 256 - n
    assert f"[--max-new-tokens 64 cut to {256 - n}: the prompt has {n} tokens and the model's context is 256]" in err


# ---- every kind of model reference (surojax.weights.model_ref) -----------------------------------------------------

ARGS = ("--prompt", "hello world", "--max-new-tokens", "6", "--ignore-eos", "--show-ids")


@pytest.fixture(scope="module")
def lora_model():
    """The fixture model with a random LoRA adapter on q/v/down (unmerged: the reference forward)."""
    from flax import nnx

    from surojax.peft.lora import apply_lora, lora_modules

    model = apply_lora(load_model(QWEN3), targets=("q_proj", "v_proj", "down_proj"), rank=4, alpha=8.0,
                       rngs=nnx.Rngs(3))
    for i, (_, mod) in enumerate(sorted(lora_modules(model).items())):
        b = mod.lora_b.get_value()
        mod.lora_b.set_value(0.5 * np.random.default_rng(i).standard_normal(b.shape).astype(np.float32))
    return model


def saved_adapter(model, out: Path, base: str) -> Path:
    from surojax.peft.peft_io import save_peft_adapter

    return save_peft_adapter(model, out, base)


@pytest.mark.parametrize("ref", ["run_folder", "adapter_folder"])
def test_a_lora_run_folder_and_its_adapter_folder(ref, capsys, tmp_path, lora_model):
    """`--model runs/x` (holding adapter/) and `--model runs/x/adapter`: the base adapter_config.json names, with the
    adapter folded in, gives the unmerged LoRA model's greedy ids (and they differ from the base's)."""
    run = tmp_path / "run"
    saved_adapter(lora_model, run / "adapter", str(QWEN3))
    rc, out, err = run_generate(capsys, "--model", str(run if ref == "run_folder" else run / "adapter"), *ARGS)
    assert rc == 0, err
    ids = shown_ids(out)
    tok = Tokenizer.from_dir(QWEN3)
    assert ids["prompt_ids"] == tok.encode("hello world")
    want = generate(lora_model, [ids["prompt_ids"]], 6)[0]
    assert ids["new_ids"] == want
    assert want != generate(load_model(QWEN3), [ids["prompt_ids"]], 6)[0]  # the adapter matters


def test_a_full_fine_tuning_run_folder(capsys, tmp_path):
    shutil.copytree(QWEN3, tmp_path / "run" / "model")
    rc, out, err = run_generate(capsys, "--model", str(tmp_path / "run"), *ARGS)
    rc2, out2, _ = run_generate(capsys, "--model", str(QWEN3), *ARGS)
    assert rc == 0 and rc2 == 0, err
    assert shown_ids(out) == shown_ids(out2)


def test_a_gguf_file(capsys, tmp_path):
    """A .gguf (written from the fixture as F32, so lossless) generates what the HF folder generates, with the
    tokenizer rebuilt from the file's metadata."""
    pytest.importorskip("gguf")
    from surojax.weights.gguf_checkpoint import save_gguf

    path = save_gguf(QWEN3, tmp_path / "tiny.gguf", "f32")
    rc, out, err = run_generate(capsys, "--model", str(path), *ARGS)
    rc2, out2, _ = run_generate(capsys, "--model", str(QWEN3), *ARGS)
    assert rc == 0 and rc2 == 0, err
    assert shown_ids(out) == shown_ids(out2) and "qwen3, float32]" in err


def test_an_adapter_keeps_working_from_another_directory(capsys, tmp_path, monkeypatch, lora_model):
    """Trained with a relative `model:` path; the adapter records it absolute and loads from anywhere."""
    shutil.copytree(QWEN3, tmp_path / "train" / "models" / "base")
    monkeypatch.chdir(tmp_path / "train")
    adapter = saved_adapter(lora_model, Path("runs/x/adapter"), "models/base").absolute()
    recorded = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(tmp_path / "train" / "models" / "base")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rc, out, err = run_generate(capsys, "--model", str(adapter), *ARGS)
    assert rc == 0, err
    assert shown_ids(out)["new_ids"] == generate(lora_model, [shown_ids(out)["prompt_ids"]], 6)[0]


def test_a_moved_base_is_a_clear_error_naming_adapter_config(capsys, tmp_path, lora_model):
    base = tmp_path / "base"
    shutil.copytree(QWEN3, base)
    adapter = saved_adapter(lora_model, tmp_path / "run" / "adapter", str(base))
    base.rename(tmp_path / "moved")
    rc, out, err = run_generate(capsys, "--model", str(tmp_path / "run"), "--prompt", "hi")
    assert rc == 1 and out == ""
    lines = error_lines(err)
    assert len(lines) == 1 and str(adapter / "adapter_config.json") in lines[0], err
    assert "base_model_name_or_path" in lines[0] and str(base) in lines[0] and "does not exist" in lines[0]


def test_a_folder_that_is_no_model_says_what_was_expected(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    for ref, want in ((tmp_path / "empty", "holds no config.json"), (tmp_path / "weights.bin", "not a .gguf file"),
                      (tmp_path / "nope.gguf", "does not exist")):
        rc, out, err = run_generate(capsys, "--model", str(ref), "--prompt", "hi")
        lines = error_lines(err)
        assert rc == 1 and len(lines) == 1 and want in lines[0] and str(ref) in lines[0], err


def test_image_flags_are_checked_and_a_text_model_refuses_them(capsys, tmp_path):
    """--image needs --chat and an existing file (said before the model loads); the text-only qwen3 fixture with
    a real image is one line naming why (serve/image_prompt.py parses it as the server does)."""
    absent = str(tmp_path / "absent.png")
    rc, out, err = run_generate(capsys, "--model", str(tmp_path / "m"), "--prompt", "hi", "--image", absent)
    assert rc == 1 and error_lines(err) == [
        "error: --image: images go into the chat template's user message; add --chat",
        f"error: --image {absent}: no such file"]
    image = str(ROOT / "tests" / "fixtures" / "vision_chat" / "img_b.png")
    rc, out, err = run_generate(capsys, "--model", str(QWEN3), "--prompt", "What?", "--chat", "--image", image)
    assert rc == 1 and out == ""
    assert "--image: the request has images but" in err and "is a text model (model_type 'qwen3'" in err


def test_image_generation_equals_transformers_greedy(capsys):
    """`generate --chat --image` on the tiny Qwen3-VL fixture: the prompt ids and 8 greedy tokens equal
    transformers' processor + generate (tests/fixtures/models/qwen3_vl_chat/expected.json)."""
    folder = ROOT / "tests" / "fixtures" / "models" / "qwen3_vl_chat"
    exp = json.loads((folder / "expected.json").read_text())["a"]
    image = ROOT / "tests" / "fixtures" / "vision_chat" / exp["image"]
    rc, out, err = run_generate(capsys, "--model", str(folder), "--chat", "--prompt", "What is in it?", "--image",
                                str(image), "--max-new-tokens", "8", "--ignore-eos", "--show-ids")
    assert rc == 0, err
    got = shown_ids(out)
    assert got["prompt_ids"] == exp["input_ids"] and got["new_ids"] == exp["new_ids"]
