"""GRPOTrainer end to end on a tiny random qwen3: rollouts on the serving engine raise a learnable reward, the
metrics are logged, and a resume from a checkpoint inside a generation batch repeats the uninterrupted run."""
import json
import shutil

import numpy as np
import pytest

from surojax.config import config_from_dict
from surojax.train.trainers import make_trainer

REWARD_MODULE = '''
def letter_a(prompts, completions, **columns):
    """The share of the completion's characters that are the letter a (learnable from a random model)."""
    return [c.count("a") / max(len(c), 1) for c in completions]
'''


@pytest.fixture
def grpo_config(tiny_config, tmp_path, monkeypatch):
    (tmp_path / "grpo_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)  # reward functions import from the working directory
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Say {i} words:", "answer": str(i)}) + "\n")

    def make(**overrides):
        cfg = tiny_config(trainer="grpo", datasets=[{"path": str(tmp_path / "prompts.jsonl"), "type": "prompt"}],
                          sequence_len=32, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                          num_generations=4, max_completion_length=8, reward_functions=["grpo_rewards:letter_a"],
                          learning_rate=2e-2, max_steps=8, loss_type="dapo")
        cfg.update(overrides)
        return config_from_dict(cfg)
    return make


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_grpo_raises_a_learnable_reward(grpo_config, tmp_path):
    cfg = grpo_config(max_steps=12)
    make_trainer(cfg).train()
    rows = [r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "reward" in r]
    assert len(rows) == 12
    for key in ("reward", "reward_std", "reward/letter_a", "completion_length", "clip_ratio", "generation_time",
                "training_time"):
        assert all(np.isfinite(r[key]) for r in rows), key
    first = np.mean([r["reward"] for r in rows[:3]])
    last = np.mean([r["reward"] for r in rows[-3:]])
    assert last > first + 0.05, (first, last)


def test_grpo_resume_inside_a_generation_batch(grpo_config, tmp_path):
    """num_iterations 2: checkpoint 3 holds generation batch 2 with one update left; resuming there gives the
    uninterrupted run's losses and rewards for step 4."""
    make_trainer(grpo_config(max_steps=4, save_steps=1, num_iterations=2, lora=True, lora_rank=4, beta=0.05)).train()
    full = {r["step"]: r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    ckpt = tmp_path / "out" / "checkpoints"
    shutil.rmtree(ckpt / "4")
    make_trainer(grpo_config(max_steps=4, save_steps=1, num_iterations=2, lora=True, lora_rank=4, beta=0.05,
                             resume_from_checkpoint=str(ckpt / "3"))).train()
    resumed = {r["step"]: r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    assert resumed[4]["loss"] == pytest.approx(full[4]["loss"], rel=1e-6, abs=1e-7)
    assert resumed[4]["reward"] == full[4]["reward"]
    assert resumed[4]["kl"] == pytest.approx(full[4]["kl"], rel=1e-5, abs=1e-8)
