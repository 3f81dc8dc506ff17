"""A tiny training set-up shared by the trainer tests: fixture tokenizer, random from-scratch qwen3."""
import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"
TINY_QWEN3 = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


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


@pytest.fixture
def tiny_config(tmp_path):
    """A function returning a config dict (and writing its data) for a tiny fp32 run in tmp_path."""
    def make(**overrides):
        cfg = {
            "from_scratch": True, "tokenizer": str(TOKENIZER), "model_config": dict(TINY_QWEN3),
            "output_dir": str(tmp_path / "out"), "recipe": "fp32", "recompute": "none",
            "datasets": [{"path": str(write_text_data(tmp_path / "text.jsonl")), "type": "text"}],
            "sequence_len": 64, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
            "learning_rate": 3e-3, "lr_scheduler_type": "constant", "max_steps": 4, "seed": 0,
        }
        cfg.update(overrides)
        return cfg
    return make
