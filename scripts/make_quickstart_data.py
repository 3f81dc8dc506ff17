"""The quickstart's data and tokenizer: arithmetic word problems, generated deterministically (fixed seeds).

Run from the surojax venv (it needs only the `tokenizers` library):

    python scripts/make_quickstart_data.py            # writes configs/quickstart/

What is written (committed, so the quickstart needs no download; a re-run rewrites the same bytes):

    configs/quickstart/pretrain.jsonl   {"text": ...} short stories: "Tom has 3 apples. He buys 4 more. Now he
                                        has 7." (addition and subtraction of small numbers, varied names,
                                        objects and verbs) and a few plain equations "3 + 4 = 7."
    configs/quickstart/train.jsonl      alpaca {"instruction", "input", "output"}: the question ("... How many
                                        apples does Tom have now?") -> a short sentence ending with the number
                                        ("Now Tom has 7.")
    configs/quickstart/test.jsonl       held-out problems in the same format: no (name, object, verb, numbers)
                                        problem of the test set occurs in train.jsonl or in pretrain.jsonl
    configs/quickstart/prompts.jsonl    the train.jsonl questions as GRPO prompt rows: {"prompt": [{"role": "user",
                                        "content": ...}], "answer": "Now Tom has 7."} (configs/grpo_arithmetic.yaml)
    configs/quickstart/tokenizer/       byte-level BPE (1024 ids incl. <|endoftext|>, <|im_start|>, <|im_end|>)
                                        trained on this text, with a ChatML chat template (eos = <|im_end|>);
                                        built the way scripts/make_fixtures.py builds tests/fixtures/tokenizer

The pretraining stage teaches the model the stories (and so the arithmetic inside them); the LoRA stage teaches
it to answer the question in the chat format. Held-out accuracy measures both.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "configs" / "quickstart"

SEED = 1234
N_STORIES = 12000
N_EQUATIONS = 1500
N_TRAIN = 1600
N_TEST = 200
MAX_A, MAX_B = 9, 9  # operands 0..9 (a >= b for subtraction): every answer is 0..18

NAMES = {  # name -> pronoun
    "Tom": "he", "Anna": "she", "Ben": "he", "Lucy": "she", "Sam": "he", "Mia": "she", "Max": "he", "Emma": "she",
    "Leo": "he", "Zoe": "she", "Jack": "he", "Lily": "she", "Noah": "he", "Ella": "she", "Finn": "he", "Ruby": "she",
}
OBJECTS = ["apples", "pears", "books", "coins", "stickers", "marbles", "cookies", "pencils", "shells", "stamps",
           "balloons", "cards", "eggs", "flowers", "toys", "candies"]
ADD_VERBS = ["buys", "finds", "gets", "picks up", "wins", "makes"]  # "<verb> B more"
SUB_VERBS = ["eats", "gives away", "loses", "sells", "drops", "uses"]  # "<verb> B of them"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_VOCAB_SIZE = 1021  # + 3 special tokens appended after training = 1024 ids
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2's split: single digits, so numbers are digit tokens
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ----------------------------------------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------------------------------------

def all_problems() -> list[tuple]:
    """Every (op, name, object, verb, a, b) problem, in a fixed order."""
    out = []
    for name in NAMES:
        for obj in OBJECTS:
            for a in range(MAX_A + 1):
                for b in range(1, MAX_B + 1):
                    for verb in ADD_VERBS:
                        out.append(("add", name, obj, verb, a, b))
                    if a >= b:
                        for verb in SUB_VERBS:
                            out.append(("sub", name, obj, verb, a, b))
    return out


def answer(problem: tuple) -> int:
    op, _, _, _, a, b = problem
    return a + b if op == "add" else a - b


def setup(problem: tuple) -> str:
    """The first two sentences: 'Tom has 3 apples. He buys 4 more.'"""
    op, name, obj, verb, a, b = problem
    pron = NAMES[name].capitalize()
    change = f"{verb} {b} more" if op == "add" else f"{verb} {b} of them"
    return f"{name} has {a} {obj}. {pron} {change}."


def conclusion(problem: tuple, rng: random.Random | None = None) -> str:
    """'Now he has 7.' in stories (he / she or the name), 'Now Tom has 7.' as the answer to the question.

    The object is not repeated: copying it needs an attention circuit that this model does not form within
    the quickstart's few hundred steps, while the sum itself is learned."""
    name = problem[1]
    who = NAMES[name] if rng is not None and rng.random() < 0.5 else name
    return f"Now {who} has {answer(problem)}."


def story(problem: tuple, rng: random.Random) -> str:
    return f"{setup(problem)} {conclusion(problem, rng)}"


def question(problem: tuple) -> str:
    _, name, obj, _, _, _ = problem
    return f"{setup(problem)} How many {obj} does {name} have now?"


def equation(rng: random.Random) -> str:
    a, b = rng.randint(0, MAX_A), rng.randint(0, MAX_B)
    if rng.random() < 0.5:
        return f"{a} + {b} = {a + b}."
    a, b = max(a, b), min(a, b)
    return f"{a} - {b} = {a - b}."


def make_data(seed: int = SEED) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    problems = all_problems()
    rng.shuffle(problems)
    test, train, rest = problems[:N_TEST], problems[N_TEST:N_TEST + N_TRAIN], problems[N_TEST + N_TRAIN:]
    # Pretraining stories never tell a held-out test problem (train problems may appear: it is the same
    # knowledge in another format, as a pretraining corpus would have it).
    lines = [story(p, rng) for p in rest[:N_STORIES]] + [equation(rng) for _ in range(N_EQUATIONS)]
    rng.shuffle(lines)

    def qa(p):
        return {"instruction": question(p), "input": "", "output": conclusion(p)}

    def prompt(p):  # GRPO's prompt rows: the same question as a chat message, the expected answer as a column
        return {"prompt": [{"role": "user", "content": question(p)}], "answer": conclusion(p)}

    return {"pretrain": [{"text": t} for t in lines], "train": [qa(p) for p in train], "test": [qa(p) for p in test],
            "prompts": [prompt(p) for p in train]}


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------

def tokenizer_corpus(data: dict[str, list[dict]]) -> list[str]:
    lines = [r["text"] for r in data["pretrain"]]
    for r in data["train"]:  # the chat format too, so that its words are single tokens
        lines.append(f"<|im_start|>user\n{r['instruction']}<|im_end|>\n<|im_start|>assistant\n{r['output']}<|im_end|>")
    lines += ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>"] * 10
    return lines


def build_tokenizer(corpus: list[str], out_dir: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus, trainer=trainer)
    n_bpe = tok.get_vocab_size()
    # Special tokens go after the BPE ids (as in Qwen). The narrow corpus may run out of merges before
    # BPE_VOCAB_SIZE; whatever the count, the ids are dense.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert sorted(ids.values()) == list(range(n_bpe, n_bpe + len(SPECIAL_TOKENS))), ids
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                          "special": True} for t in SPECIAL_TOKENS},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    data = make_data()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in data.items():
        write_jsonl(args.out / f"{name}.jsonl", rows)
    build_tokenizer(tokenizer_corpus(data), args.out / "tokenizer")
    sizes = {p.relative_to(args.out).as_posix(): p.stat().st_size for p in sorted(args.out.rglob("*")) if p.is_file()}
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sizes.items())
          + f"; {sum(sizes.values()) / 2**20:.2f} MiB in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
