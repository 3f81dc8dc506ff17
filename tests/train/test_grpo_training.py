"""GRPOTrainer end to end on a tiny random qwen3: rollouts on the serving engine raise a learnable reward, the
metrics are logged, and a resume from a checkpoint inside a generation batch repeats the uninterrupted run."""
import json
import shutil

import numpy as np
import pytest

from tests.train.conftest import ROOT

from surojax.config import config_from_dict
from surojax.train.trainers import make_trainer

def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_grpo_raises_a_learnable_reward(grpo_config, tmp_path):
    cfg = grpo_config(max_steps=30, learning_rate=5e-2)
    make_trainer(config_from_dict(cfg)).train()
    rows = [r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "reward" in r]
    assert len(rows) == 30
    for key in ("reward", "reward_std", "reward/letter_a", "completion_length", "clip_ratio", "generation_time",
                "training_time"):
        assert all(np.isfinite(r[key]) for r in rows), key
    first = np.mean([r["reward"] for r in rows[:5]])
    last = np.mean([r["reward"] for r in rows[-5:]])
    assert last > first + 0.1, (first, last)


def test_grpo_resume_inside_a_generation_batch(grpo_config, tmp_path):
    """LoRA, beta > 0 (the reference = the adapter off), num_iterations 2: checkpoint 1 holds the generation batch
    with one update left; resuming there gives the uninterrupted run's loss, reward and KL at step 2."""
    lora = dict(max_steps=2, save_steps=1, num_iterations=2, lora=True, lora_rank=4, beta=0.05, from_scratch=False,
                model=str(ROOT / "tests" / "fixtures" / "models" / "qwen3"), model_config=None, learning_rate=1e-2)
    make_trainer(grpo_config(**lora)).train()
    full = {r["step"]: r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    ckpt = tmp_path / "out" / "checkpoints"
    shutil.rmtree(ckpt / "2")
    make_trainer(grpo_config(**lora, resume_from_checkpoint=str(ckpt / "1"))).train()
    resumed = {r["step"]: r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    assert resumed[2]["loss"] == pytest.approx(full[2]["loss"], rel=1e-6, abs=1e-7)
    assert resumed[2]["reward"] == full[2]["reward"]
    assert resumed[2]["kl"] == pytest.approx(full[2]["kl"], rel=1e-5, abs=1e-8)


def test_grpo_command_refuses_another_trainer(tmp_path, capsys):
    from surojax.cli.main import main
    config = tmp_path / "sft.yaml"
    config.write_text("trainer: sft\nmodel: m\ndatasets: [{path: d.jsonl}]\n")
    assert main(["grpo", str(config)]) == 2
    assert "trainer: sft is not a GRPO run" in capsys.readouterr().err
