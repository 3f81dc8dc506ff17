"""GRPOTrainer end to end on a tiny random qwen3: rollouts on the serving engine raise a learnable reward and the
metrics are logged (the exact resume inside a generation batch: tests/train/test_post_training_resume.py)."""
import json

import numpy as np

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


def test_grpo_command_refuses_another_trainer(tmp_path, capsys):
    from surojax.cli.main import main
    config = tmp_path / "sft.yaml"
    config.write_text("trainer: sft\nmodel: m\ndatasets: [{path: d.jsonl}]\n")
    assert main(["grpo", str(config)]) == 2
    assert "trainer: sft is not a GRPO run" in capsys.readouterr().err
