"""Greedy continuations for the serving engine's hybrid tests: transformers' greedy generation on the committed
Qwen3.5 text fixtures (tests/fixtures/models/qwen3_5_text, qwen3_5_moe_text; made by make_qwen3_5_fixtures.py),
for several prompts of different lengths (so that one engine run batches them, prefills some in several chunks and
reuses state slots).

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_qwen3_5_serve_fixtures.py   # -> tests/fixtures/models/NAME/serve_greedy.npz

serve_greedy.npz: prompt0..4 (int64; lengths PROMPT_LENGTHS, random ids from a seeded generator) and greedy0..4
([NEW_TOKENS] int64: transformers' cached greedy generation after each prompt alone, in float64, as
expected.npz's greedy). The smallest gap between the top two logits over every generated token is printed (the
fp32 engine must not flip a near tie).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "tests" / "fixtures" / "models"
NAMES = ("qwen3_5_text", "qwen3_5_moe_text")
PROMPT_LENGTHS = (3, 7, 12, 26, 41)
NEW_TOKENS = 12
SEED = 38


def make(name: str) -> None:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / name, dtype=torch.float64,
                                                 attn_implementation="eager").eval()
    if "moe" in name:  # transformers' eager experts loop (torch._grouped_mm has no float64)
        model.set_experts_implementation("eager")
    rng = np.random.default_rng(SEED)
    arrays, gaps = {}, []
    for i, n in enumerate(PROMPT_LENGTHS):
        prompt = rng.integers(0, model.config.vocab_size, size=n)
        with torch.no_grad():
            out = model.generate(torch.tensor(prompt)[None], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
        for scores in out.scores:
            top = torch.topk(scores[0], 2).values
            gaps.append(float(top[0] - top[1]))
        arrays[f"prompt{i}"], arrays[f"greedy{i}"] = prompt, out.sequences[0, n:].numpy()
    np.savez(MODELS_DIR / name / "serve_greedy.npz", **arrays)
    print(f"{name}: smallest top-1 - top-2 logit gap {min(gaps):.2e}")


if __name__ == "__main__":
    for name in NAMES:
        make(name)
