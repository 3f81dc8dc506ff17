"""GRPOTrainer end to end on a tiny random qwen3: rollouts on the serving engine raise a learnable reward and the
metrics are logged (the exact resume inside a generation batch: tests/train/test_post_training_resume.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.config import config_from_dict
from surojax.offload.memory_plan import MemoryPlanError
from surojax.offload.device_budget import check_beside
from surojax.train.grpo import rollout_besides
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


def test_grpo_kl_reference_under_full_fine_tuning(grpo_config, tmp_path):
    """beta > 0 without LoRA: a frozen copy of the initial weights is the reference. Step 1's KL is 0 (policy ==
    reference), later steps' is not, and the last generation batch's ref_logps are the initial model's log-probs
    (a plain forward of the initial weights, log_softmax(logits / temperature) at the targets, in numpy)."""
    trainer = make_trainer(config_from_dict(grpo_config(max_steps=2, beta=0.04, temperature=0.8)))
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


def test_the_data_summary_of_prompt_rows_counts_prompts(tmp_path):
    """GRPO's start-up data line reports what prompt rows hold (prompts, prompt tokens), not supervised tokens and
    packing efficiency, which prompts (completions generated in training) have none of."""
    from surojax.data.pipeline import DataStats
    from surojax.data.prompts import load_prompts
    from surojax.data.tokenizer import Tokenizer
    from tests.train.conftest import TOKENIZER

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i} words:"}) + "\n" for i in range(8)))
    tokenizer = Tokenizer.from_dir(TOKENIZER)
    stats = DataStats(sequence_len=32)
    prompts = load_prompts([{"path": str(data), "type": "prompt"}], tokenizer, max_prompt_len=24, stats=stats)
    n = sum(len(p.ids) for p in prompts)
    assert stats.summary() == f"8 prompts, {n} prompt tokens ({n / 8:.1f} per prompt; the completions are generated " \
                              "in training)"
