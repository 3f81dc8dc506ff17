"""GRPOTrainer end to end on a tiny random qwen3: rollouts on the serving engine raise a learnable reward, the
metrics are logged, and a resume from a checkpoint inside a generation batch repeats the uninterrupted run."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train.conftest import ROOT

from surojax.config import config_from_dict
from surojax.offload.memory_plan import MemoryPlanError
from surojax.offload.device_budget import check_beside
from surojax.train.grpo import rollout_besides
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
    cfg = grpo_config(max_steps=30, learning_rate=5e-2)
    make_trainer(cfg).train()
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


def test_grpo_kl_reference_under_full_fine_tuning(grpo_config, tmp_path):
    """beta > 0 without LoRA: a frozen copy of the initial weights is the reference. Step 1's KL is 0 (policy ==
    reference), later steps' is not, and the last generation batch's ref_logps are the initial model's log-probs
    (a plain forward of the initial weights, log_softmax(logits / temperature) at the targets, in numpy)."""
    trainer = make_trainer(grpo_config(max_steps=2, beta=0.04, temperature=0.8))
    initial = jax.tree.map(np.asarray, trainer.trainable)
    trainer.train()
    kl = [r["kl"] for r in _rows(tmp_path / "out" / "metrics.jsonl") if "kl" in r]
    assert len(kl) == 2 and kl[0] < 1e-7 and kl[1] > 1e-5, kl

    rows = trainer._pending.rows
    model = nnx.merge(trainer.run.eval_graphdef, jax.tree.map(jnp.asarray, initial), trainer.frozen)
    logits = np.asarray(jax.jit(lambda m, *a: m(*a))(model, *(jnp.asarray(rows[k]) for k in (
        "tokens", "positions", "segment_ids"))), np.float64) / 0.8
    logits -= logits.max(-1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.take_along_axis(log_softmax, rows["targets"][..., None], -1)[..., 0]
    real = rows["segment_ids"] > 0
    np.testing.assert_allclose(rows["ref_logps"][real], want[real], rtol=1e-5, atol=2e-5)

    # the start-up check names the reference copy and its size, and how to do without it (bytes per device)
    gib = 2**30
    besides = rollout_besides(2 * gib, 3 * gib, blocks=16, rows=8, sequence_len=32)
    assert check_beside(None, besides, 6 * gib) == 5 * gib
    with pytest.raises(MemoryPlanError, match=r"KL reference copy 3.00 GiB .*beta: 0"):
        check_beside(None, besides, 4 * gib)


def test_grpo_command_refuses_another_trainer(tmp_path, capsys):
    from surojax.cli.main import main
    config = tmp_path / "sft.yaml"
    config.write_text("trainer: sft\nmodel: m\ndatasets: [{path: d.jsonl}]\n")
    assert main(["grpo", str(config)]) == 2
    assert "trainer: sft is not a GRPO run" in capsys.readouterr().err
