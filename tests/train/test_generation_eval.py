"""Generation eval: scoring rules, rows -> prompts, and greedy answers of a tiny model scored end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from surojax.config import config_from_dict
from surojax.data.tokenizer import Tokenizer
from surojax.generation.loop import generate
from surojax.train.generation_eval import (
    EvalExample, GenerationEval, GenerationEvalError, evaluate_generation, example_from_row, is_correct,
    last_number, load_eval_examples, prompt_ids, report, stop_ids,
)

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "tests" / "fixtures" / "models" / "qwen3"
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"


# ---- scoring ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expected, got, ok", [
    ("Now Tom has 7.", "Now Tom has 7.", True),
    ("Now Tom has 7.", "7", True),                      # the last numbers are compared
    ("7", "I think it is 3, no: 7", True),
    ("7", "7 or maybe 3", False),                       # ... the last one, not any
    ("12", "12.0", True),
    ("1,000", "It is 1000.", True),
    ("-3", "minus: -3", True),
    ("Now Tom has 7.", "Now Tom has seven.", False),    # no number in the answer
    ("Paris", "  Paris ", True),                        # no number: whole text, whitespace normalised
    ("the  capital\nis Paris", "the capital is Paris", True),
    ("Paris", "paris", False),
    ("Paris", "Paris.", False),
])
def test_is_correct(expected, got, ok):
    assert is_correct(expected, got) is ok


def test_last_number():
    assert last_number("a 3 b 45 c") == 45.0
    assert last_number("no digits") is None
    assert last_number("2.5 then 3.75.") == 3.75


# ---- rows -> examples -------------------------------------------------------------------------------------------

def test_instruction_row_with_input_and_system():
    ex = example_from_row({"instruction": "Add.", "input": "2 and 3", "output": "5", "system": "Be brief."})
    assert ex.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add.\n\n2 and 3"}]
    assert ex.expected == "5" and ex.prompt_text == "Add.\n\n2 and 3"
    ex = example_from_row({"prompt": "2+3?", "completion": "5"})
    assert ex.messages == [{"role": "user", "content": "2+3?"}] and ex.expected == "5"


def test_conversation_rows_end_at_the_last_assistant_turn():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ex = example_from_row({"messages": msgs})
    assert ex.messages == msgs[:3] and ex.expected == "4"
    ex = example_from_row({"conversations": [{"from": "human", "value": "1+1?"}, {"from": "gpt", "value": "2"}]})
    assert ex.messages == [{"role": "user", "content": "1+1?"}] and ex.expected == "2"
    with pytest.raises(GenerationEvalError, match="assistant turn"):
        example_from_row({"messages": [{"role": "user", "content": "hi"}]}, "conversation")


def test_load_names_the_bad_row(tmp_path):
    p = tmp_path / "eval.jsonl"
    p.write_text(json.dumps({"instruction": "q", "output": "1"}) + "\n" + json.dumps({"instruction": "q"}) + "\n")
    with pytest.raises(GenerationEvalError, match=r"eval\.jsonl:2: instruction rows need"):
        load_eval_examples(p, type="instruction")
    assert len(load_eval_examples(p, type="instruction", samples=1)) == 1


# ---- generation on a tiny model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from surojax.weights.hf_checkpoint import load_model

    return load_model(QWEN3), Tokenizer.from_dir(TOKENIZER)


def test_prompt_uses_the_chat_template_with_generation_prompt(tiny):
    _, tok = tiny
    ex = EvalExample([{"role": "user", "content": "What is 2 + 3?"}], "5")
    text = tok.decode(prompt_ids(tok, ex))
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id in stop_ids(tok)


def test_accuracy_counts_exact_matches_of_greedy_answers(tiny):
    model, tok = tiny
    questions = ["What is 2 + 3?", "Say hello.", "The weather today is", "Write a poem."]
    examples = [EvalExample([{"role": "user", "content": q}], "") for q in questions]
    # The model's own greedy answers: three of them are expected, the fourth expects something else.
    own = [tok.decode(ids, skip_special_tokens=True)
           for ids in generate(model, [prompt_ids(tok, ex) for ex in examples], 6, stop_ids=stop_ids(tok))]
    right = [EvalExample(ex.messages, got) for ex, got in zip(examples[:3], own)]
    wrong = [EvalExample(examples[3].messages, "12345" if last_number(own[3]) != 12345 else "54321")]
    res = evaluate_generation(model, tok, right + wrong, max_new_tokens=6, batch_size=4, show=2)
    assert (res.correct, res.total) == (3, 4) and res.accuracy == 0.75
    assert len(res.samples) == 2
    assert res.samples[0] == {"prompt": questions[0], "expected": own[0], "got": own[0].strip(), "correct": True}
    assert res.to_dict()["accuracy"] == 0.75


def test_from_config_runs_and_reports(tiny, tmp_path):
    model, tok = tiny
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} + 1?", "output": str(i + 1)}) + "\n"
                            for i in range(5)))
    cfg = config_from_dict({"model": str(QWEN3), "datasets": [{"path": str(data)}],
                            "eval_generation": {"path": str(data), "max_new_tokens": 4, "show": 1, "samples": 3,
                                                "batch_size": 2}})
    ev = GenerationEval.from_config(cfg, tok)
    assert len(ev.examples) == 3
    res = ev.run(model)
    assert res.total == 3 and 0.0 <= res.accuracy <= 1.0 and len(res.samples) == 1
    out = report(res, res, path=tmp_path / "out" / "generation_eval.json", dataset=str(data))
    saved = json.loads((tmp_path / "out" / "generation_eval.json").read_text())
    assert saved == json.loads(json.dumps(out)) and saved["after"]["total"] == 3 and saved["dataset"] == str(data)
    no_eval = config_from_dict({"model": str(QWEN3), "datasets": [{"path": str(data)}]})
    assert GenerationEval.from_config(no_eval, tok) is None


def test_a_resumed_run_keeps_the_before_figures_of_its_start(tmp_path, monkeypatch):
    """A stage stopped at step 2 (a checkpoint there) and resumed reports and saves the "before training" figures
    measured at its start (kept in generation_eval.json), never a measurement of its resumed weights."""
    import signal

    from surojax.config.stages import Stage
    from surojax.train import metrics as metrics_module
    from surojax.train.interrupts import Interrupts
    from surojax.train.stages import run_stage

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} + 1?", "output": str(i + 1)}) + "\n"
                            for i in range(8)))
    cfg = config_from_dict({"model": str(QWEN3), "datasets": [{"path": str(data)}], "output_dir": str(tmp_path / "o"),
                            "lora": True, "lora_rank": 4, "recipe": "fp32", "sequence_len": 32, "learning_rate": 1e-2,
                            "max_steps": 4, "save_steps": 2, "report_to": [],
                            "eval_generation": {"path": str(data), "max_new_tokens": 3, "show": 2, "samples": 3}})
    interrupts = Interrupts()  # (not entered: the test sets its flag after step 2, as a Ctrl-C would)
    write = metrics_module.Metrics.write

    def write_then_stop(self, step, metrics):
        write(self, step, metrics)
        if step == 2:
            interrupts.signum = signal.SIGINT

    monkeypatch.setattr(metrics_module.Metrics, "write", write_then_stop)
    assert run_stage(Stage(None, cfg), interrupts=interrupts).interrupted
    start = json.loads((tmp_path / "o" / "generation_eval.json").read_text())
    assert start["after"] is None and start["before"]["total"] == 3

    monkeypatch.setattr(metrics_module.Metrics, "write", write)
    measured = []
    run = GenerationEval.run
    monkeypatch.setattr(GenerationEval, "run", lambda self, model: measured.append(run(self, model)) or measured[-1])
    result = run_stage(Stage(None, cfg.model_copy(update={"resume_from_checkpoint": True})))
    assert len(measured) == 1  # after training only: the resumed weights are never measured as "before"
    saved = json.loads((tmp_path / "o" / "generation_eval.json").read_text())
    assert saved["before"] == start["before"] == result.generation_eval["before"]
    assert saved["after"] == measured[0].to_dict()
