"""Generation eval: greedy answers to held-out prompts, scored by exact match of the expected answer.

    examples = load_eval_examples("test.jsonl", type="instruction", samples=200)
    result = evaluate_generation(model, tokenizer, examples, max_new_tokens=32, show=3)
    result.accuracy, result.samples          # 0.87, [{"prompt", "expected", "got", "correct"}, ...]

Each row gives a prompt (the conversation up to its last assistant turn) and the expected answer (that turn):
instruction rows (alpaca instruction/input/output, or prompt/completion) are rendered as user -> assistant the
way the training data format renders them; conversation rows (`messages` or sharegpt `conversations`) end with
the assistant turn to predict. The prompt goes through the chat template with add_generation_prompt (the plain
alpaca "### Response:" prompt when the tokenizer has no template), and `surojax.generation.loop` answers all
prompts in batches, greedily, until EOS or max_new_tokens.

Scoring (`is_correct`): whitespace is normalised (runs collapsed, ends stripped). When the expected answer holds
a number, the last number of the answer is compared with the last number of the expected text (as numbers:
"7" == "7.0"); otherwise the whole normalised texts must be equal.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from surojax.config.data import DatasetSpec
from surojax.config.generation_eval import GenerationEvalSpec
from surojax.config.schema import TrainConfig
from surojax.data.formats import _messages, detect_type
from surojax.data.pipeline import chat_template_text, formatted_rows
from surojax.data.sources import DataError, InvalidRowError, ReadStats, read_rows
from surojax.data.tokenizer import ChatTemplateError, Tokenizer
from surojax.generation.loop import generate

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


class GenerationEvalError(ValueError):
    """An eval dataset that cannot be used (missing fields, no assistant turn to score ...)."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class EvalExample:
    messages: list[dict]  # the conversation to answer (ends with a user turn)
    expected: str

    @property
    def prompt_text(self) -> str:
        """The last user message: what the samples show as the prompt."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


@dataclasses.dataclass
class GenerationEvalResult:
    correct: int
    total: int
    samples: list[dict]  # {"prompt", "expected", "got", "correct"} for the first `show` examples

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "correct": self.correct, "total": self.total, "samples": self.samples}

    @classmethod
    def from_dict(cls, d: Mapping) -> GenerationEvalResult:
        return cls(int(d["correct"]), int(d["total"]), list(d.get("samples") or []))


# ---- scoring ----------------------------------------------------------------------------------------------------

def normalize(text: str) -> str:
    return " ".join(text.split())


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def is_correct(expected: str, got: str) -> bool:
    """Exact match after normalising whitespace; the last numbers when the expected text has a number."""
    want = last_number(expected)
    if want is not None:
        return last_number(got) == want
    return normalize(expected) == normalize(got)


# ---- examples ---------------------------------------------------------------------------------------------------

def example_from_row(row: Mapping, kind: str = "auto", spec: DatasetSpec | None = None) -> EvalExample:
    """One dataset row -> EvalExample. `spec` carries the *_field names and system_prompt (default: DatasetSpec's)."""
    fs = spec if spec is not None else DatasetSpec(path="<row>")  # the default field names; no file behind it
    if kind == "auto":
        kind, _ = detect_type(row, fs)
    if kind == "instruction":
        if fs.instruction_field not in row and "prompt" in row and "completion" in row:
            instruction, inp, output = row["prompt"], "", row["completion"]
        else:
            instruction, inp, output = row.get(fs.instruction_field), row.get(fs.input_field) or "", \
                row.get(fs.output_field)
        if not isinstance(instruction, str) or not isinstance(output, str):
            raise GenerationEvalError(f"instruction rows need string fields {fs.instruction_field!r} and "
                                      f"{fs.output_field!r} (columns: {sorted(row)})")
        system = row.get("system") if isinstance(row.get("system"), str) and row.get("system") else fs.system_prompt
        user = instruction + ("\n\n" + inp if isinstance(inp, str) and inp.strip() else "")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return EvalExample(messages, output)
    if kind == "conversation":
        messages = _messages(row, fs)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None or not isinstance(messages[last].get("content"), str):
            raise GenerationEvalError("a conversation row needs an assistant turn with text content to score")
        return EvalExample(messages[:last], messages[last]["content"])
    raise GenerationEvalError(f"type {kind!r} has no expected answer to score; use instruction or conversation")


def load_eval_examples(path: str | Path, *, type: str = "auto", samples: int | None = None,
                       spec: DatasetSpec | None = None, split: str = "train",
                       subset: str | None = None, data_files=None) -> list[EvalExample]:
    """Read a dataset (any format `surojax.data.sources` reads) into EvalExamples; errors name the row."""
    rows = read_rows(path, split=split, subset=subset, data_files=data_files, samples=samples)
    out = list(formatted_rows(rows, lambda row: example_from_row(row, type, spec), skip_invalid_rows=False,
                              read=ReadStats(), invalid=(GenerationEvalError, InvalidRowError, DataError),
                              error=lambda where, e: GenerationEvalError(f"eval_generation: {where}: {e}")))
    if not out:
        raise GenerationEvalError(f"eval_generation: {path} has no rows")
    return out


# ---- generation -------------------------------------------------------------------------------------------------

def prompt_ids(tokenizer: Tokenizer, example: EvalExample, chat_template: str | None = None) -> list[int]:
    """The prompt as the model saw such rows in training, ending where the answer starts."""
    try:
        template = tokenizer.get_chat_template(chat_template)
    except ChatTemplateError:
        template = None
    if template is not None:
        return tokenizer.apply_chat_template(example.messages, add_generation_prompt=True, chat_template=template)
    if any(m["role"] not in ("system", "user") for m in example.messages):
        raise GenerationEvalError("conversation prompts need a chat template (the tokenizer has none)")
    system = next((m["content"] for m in example.messages if m["role"] == "system"), None)
    # The plain alpaca prompt of surojax.data.formats (the instruction is the whole user message here).
    text = (system + "\n\n" if system else "") + f"### Instruction:\n{example.prompt_text}\n\n### Response:\n"
    return tokenizer.encode(text, add_special_tokens=True)


def stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"):
        ids.add(tokenizer.token_to_id(token) if token in tokenizer.backend.get_vocab() else None)
    return tuple(sorted(i for i in ids if i is not None))


def generate_answers(model, tokenizer: Tokenizer, examples: Sequence[EvalExample], *, max_new_tokens: int = 64,
                     batch_size: int = 256, chat_template: str | None = None) -> list[str]:
    """Greedy answers (decoded without special tokens), in the order of `examples`."""
    prompts = [prompt_ids(tokenizer, ex, chat_template) for ex in examples]
    limit = model.cfg.max_position_embeddings
    if limit and max(len(p) for p in prompts) + max_new_tokens > limit:
        raise GenerationEvalError(f"eval_generation: the longest prompt ({max(len(p) for p in prompts)} tokens) plus "
                                  f"max_new_tokens ({max_new_tokens}) exceeds the model's {limit} positions")
    stops = stop_ids(tokenizer)
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        new = generate(model, prompts[start:start + batch_size], max_new_tokens, temperature=0.0, stop_ids=stops)
        answers += [tokenizer.decode(ids, skip_special_tokens=True) for ids in new]
    return answers


def evaluate_generation(model, tokenizer: Tokenizer, examples: Sequence[EvalExample], *, max_new_tokens: int = 64,
                        batch_size: int = 256, show: int = 3, chat_template: str | None = None
                        ) -> GenerationEvalResult:
    """Accuracy of greedy answers on `examples` plus the first `show` (prompt, expected, got) samples."""
    answers = generate_answers(model, tokenizer, examples, max_new_tokens=max_new_tokens, batch_size=batch_size,
                               chat_template=chat_template)
    marks = [is_correct(ex.expected, got) for ex, got in zip(examples, answers)]
    samples = [{"prompt": ex.prompt_text, "expected": ex.expected, "got": got.strip(), "correct": ok}
               for ex, got, ok in list(zip(examples, answers, marks))[:show]]
    return GenerationEvalResult(sum(marks), len(examples), samples)


# ---- from a config ----------------------------------------------------------------------------------------------

class GenerationEval:
    """The `eval_generation:` key of a config, loaded once and run on any number of models.

        ev = GenerationEval.from_config(cfg, tokenizer)     # None when the config has no eval_generation
        before = ev.run(model)
    """

    def __init__(self, spec: GenerationEvalSpec, tokenizer: Tokenizer, chat_template: str | None = None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.examples = load_eval_examples(spec.path, type=spec.type, samples=spec.samples, spec=spec,
                                           split=spec.split, subset=spec.subset, data_files=spec.data_files)

    @classmethod
    def from_config(cls, cfg: TrainConfig, tokenizer: Tokenizer) -> GenerationEval | None:
        if cfg.eval_generation is None:
            return None

        return cls(cfg.eval_generation, tokenizer, chat_template_text(cfg.chat_template))

    def run(self, model) -> GenerationEvalResult:
        return evaluate_generation(model, self.tokenizer, self.examples,
                                   max_new_tokens=self.spec.max_new_tokens, batch_size=self.spec.batch_size,
                                   show=self.spec.show, chat_template=self.chat_template)


def save_before(path: str | Path, before: GenerationEvalResult, dataset: str | None) -> None:
    """Write the before-training figures to `path` (generation_eval.json, "after": null) as soon as they are
    measured: a run resumed from a checkpoint reads them back (`saved_before`) instead of measuring its resumed
    weights; `report` replaces the file at the end of the run."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    out = {"dataset": dataset, "before": before.to_dict(), "after": None}
    Path(path).write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def saved_before(path: str | Path, dataset: str | None, total: int) -> GenerationEvalResult | None:
    """The before-training figures `save_before` wrote to `path` for the same dataset and number of examples;
    None when there are none (no file, an unreadable one, another eval)."""
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
        before = saved["before"]
        if saved.get("dataset") != dataset or before is None or int(before["total"]) != total:
            return None
        return GenerationEvalResult.from_dict(before)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def report(before: GenerationEvalResult | None, after: GenerationEvalResult, *, path: str | Path | None = None,
           dataset: str | None = None, console=None) -> dict:
    """Print "accuracy before -> after" and the samples as rich tables; write them as JSON to `path`."""
    console = console or Console(stderr=True)
    table = Table(title="generation eval: greedy answers, exact match", caption=dataset)
    table.add_column("examples", justify="right")
    if before is not None:
        table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    pct = lambda r: f"{100 * r.accuracy:.1f}% ({r.correct}/{r.total})"  # noqa: E731
    table.add_row(str(after.total), *([pct(before)] if before is not None else []), pct(after))
    console.print(table)
    for label, res in (("before", before), ("after", after)):
        if res is None or not res.samples:
            continue
        t = Table(title=f"samples {label} training", show_lines=True)
        for col in ("prompt", "expected", "got"):
            t.add_column(col, overflow="fold")
        t.add_column("", justify="center")
        for s in res.samples:
            t.add_row(s["prompt"], s["expected"], s["got"] or "(nothing)",
                      "[green]ok[/]" if s["correct"] else "[red]x[/]")
        console.print(t)
    out = {"dataset": dataset, "before": before.to_dict() if before is not None else None, "after": after.to_dict()}
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
