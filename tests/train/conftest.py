"""A tiny training set-up shared by the trainer tests: fixture tokenizer, random from-scratch qwen3, and the data /
configs of the post-training trainers (DPO pairs, GRPO prompts + reward module, distillation keys)."""
import json
import random
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.weights.hf_checkpoint import save_model
from tests.tiny import QWEN3

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"
FIXTURE_QWEN3 = ROOT / "tests" / "fixtures" / "models" / "qwen3"  # the tiny HF qwen3 (512-token tokenizer)
TINY_QWEN3 = QWEN3  # the shared preset (tests/tiny.py), under the name the trainer tests import


def write_text_data(path: Path, n: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            f.write(json.dumps({"text": f"Tom has {a} apples. He buys {b} more. Now he has {a + b} apples."}) + "\n")
    return path


def write_instruction_data(path: Path, n: int = 48, seed: int = 1) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"instruction": f"What is {a} plus {b}?", "input": "", "output": str(a + b)}) + "\n")
    return path


def tiny_run_config(directory: Path, **overrides) -> dict:
    """A config dict (and its data, written in `directory`) for a tiny fp32 run in `directory`: the tiny_config
    fixture's, callable where there are no fixtures (a check in tests/parallel/virtual_devices.py's shared child)."""
    cfg = {
        "from_scratch": True, "tokenizer": str(TOKENIZER), "model_config": dict(TINY_QWEN3),
        "output_dir": str(directory / "out"), "recipe": "fp32", "recompute": "none",
        "datasets": [{"path": str(write_text_data(directory / "text.jsonl")), "type": "text"}],
        "sequence_len": 64, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3, "lr_scheduler_type": "constant", "max_steps": 4, "seed": 0,
    }
    cfg.update(overrides)
    return cfg


@pytest.fixture
def tiny_config(tmp_path):
    """A function returning a config dict (and writing its data) for a tiny fp32 run in tmp_path."""
    def make(**overrides):
        return tiny_run_config(tmp_path, **overrides)
    return make


def write_pairs(path: Path, n: int = 24, seed: int = 0) -> Path:
    """DPO pairs, standard and conversational: the right sum is chosen, a wrong one rejected."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            q, good, bad = f"What is {a} plus {b}?", str(a + b), str(a + b + rng.randint(1, 5))
            if i % 2:
                row = {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": good}],
                       "rejected": [{"role": "assistant", "content": bad}]}
            else:
                row = {"prompt": q, "chosen": good, "rejected": bad}
            f.write(json.dumps(row) + "\n")
    return path


GRPO_REWARD_MODULE = '''
def letter_a(prompts, completions, **columns):
    """The share of the completion's characters that are the letter a (learnable from a random model)."""
    return [c.count("a") / max(len(c), 1) for c in completions]
'''


@pytest.fixture
def grpo_config(tiny_config, tmp_path, monkeypatch):
    """A function returning a `trainer: grpo` config dict over 8 prompts with the reward `grpo_rewards:letter_a`,
    whose module is written in tmp_path, the working directory (reward functions import from there; a subprocess
    running the config needs cwd=tmp_path too)."""
    (tmp_path / "grpo_rewards.py").write_text(GRPO_REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Say {i} words:", "answer": str(i)}) + "\n")

    def make(**overrides):
        cfg = tiny_config(trainer="grpo", datasets=[{"path": str(tmp_path / "prompts.jsonl"), "type": "prompt"}],
                          sequence_len=32, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                          num_generations=4, max_completion_length=8, reward_functions=["grpo_rewards:letter_a"],
                          learning_rate=2e-2, max_steps=8, loss_type="dapo")
        cfg.update(overrides)
        return cfg
    return make


def distill_config(tiny_config, **overrides) -> dict:
    """A `trainer: distill` config dict: the random tiny student learns from the fixture qwen3 teacher (top-16)."""
    keys = dict(trainer="distill", teacher=str(FIXTURE_QWEN3), teacher_top_k=16, alpha=0.5, temperature=2.0,
                learning_rate=1e-2)
    return tiny_config(**{**keys, **overrides})


FIXTURES = ROOT / "tests" / "fixtures" / "models"  # the parity fixtures (vocabularies of 256: below the tokenizer's)


def write_hybrid_model(path: Path, seed: int = 0, family: str = "qwen3_5_text") -> Path:
    """A random model of a parity fixture's architecture (default the qwen3_5_text hybrid: five Gated DeltaNet layers
    and one gated attention layer; lfm2: short-conv and attention layers; gemma3_text / gemma4_text: sliding and
    full layers) with the fixture tokenizer's 512-token vocabulary, saved with that tokenizer in `path`: the model
    the post-training trainers run on (the fixtures' own vocabularies are smaller than the tokenizer)."""
    hf = json.loads((FIXTURES / family / "config.json").read_text())
    model = Decoder(ModelConfig.from_hf({**hf, "vocab_size": 512}), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    return save_model(model, path, tokenizer_dir=TOKENIZER)
