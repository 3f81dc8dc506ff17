"""DPO through the Trainer on the tiny qwen3 fixture: LoRA (reference = the adapter disabled) run by `surojax dpo`,
and full fine-tuning (reference log-probs from one pass before training). Both start at ln 2 (policy ==
reference), the loss goes down and the reward accuracy goes up; the LoRA adapter exports as a PEFT folder that
peft (reference env, skipped in CI) loads and that prefers the chosen answers."""
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from surojax.cli.main import main
from surojax.config import config_from_dict
from surojax.train.dpo import DPOTrainer
from surojax.train.trainers import make_trainer

from tests.train.conftest import FIXTURE_QWEN3 as BASE, ROOT, write_hybrid_model, write_pairs

REFENV = Path("/work/refenv/bin/python")


def _cfg(tmp_path, **kw):
    return {**dict(model=str(BASE), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none",
                   datasets=[{"path": str(write_pairs(tmp_path / "pairs.jsonl")), "type": "preference"}],
                   sequence_len=32, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                   learning_rate=2e-2, lr_scheduler_type="constant", max_steps=8, seed=0, beta=0.5), **kw}


def _metrics(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _check_learns(rows: list[dict]) -> None:
    assert len(rows) == 8
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference at step 1
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies"):
        assert k in rows[0]
    assert np.mean([r["loss"] for r in rows[-3:]]) < rows[0]["loss"] - 0.05
    assert np.mean([r["rewards/accuracies"] for r in rows[-3:]]) > 0.6
    assert rows[-1]["rewards/margins"] > 0


def test_lora_dpo_through_the_cli_learns_and_exports(tmp_path):
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump(_cfg(tmp_path, lora=True, lora_rank=4, lora_alpha=8, logging_steps=1)))
    assert main(["dpo", str(config)]) == 0
    out = tmp_path / "out"
    _check_learns(_metrics(out))
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    if not REFENV.exists():
        pytest.skip("peft check needs the reference env (transformers + peft)")
    script = ROOT / "tests" / "train" / "peft_prefers_chosen.py"
    res = subprocess.run([str(REFENV), str(script), str(BASE), str(adapter), str(tmp_path / "pairs.jsonl")],
                         capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    preferred = float(res.stdout.strip().splitlines()[-1])
    assert preferred >= 0.75, res.stdout


def test_full_finetune_dpo_uses_a_reference_pass(tmp_path):
    trainer = make_trainer(config_from_dict(_cfg(tmp_path, trainer="dpo", learning_rate=2e-3, logging_steps=1)))
    assert isinstance(trainer, DPOTrainer) and trainer._reference["train"].shape == (24, 2)
    trainer.train()
    _check_learns(_metrics(tmp_path / "out"))
    assert (tmp_path / "out" / "model" / "config.json").is_file()


def test_cli_refuses_another_trainer(tmp_path):
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump(_cfg(tmp_path, trainer="sft")))
    assert main(["dpo", str(config)]) != 0


def test_dpo_on_a_mixture_of_experts_adds_its_router_loss(tmp_path):
    """LoRA DPO on the qwen3_moe fixture with an explicit router_aux_loss_coef: step 1's loss is ln 2 (policy ==
    reference) plus coef x the policy's load-balancing loss (one micro-batch: the logged aux is its own), the
    router metrics are logged, and the DPO part goes down."""
    moe = ROOT / "tests" / "fixtures" / "models" / "qwen3_moe"
    coef = 0.25
    cfg = _cfg(tmp_path, trainer="dpo", model=str(moe), lora=True, lora_rank=4, lora_alpha=8, max_steps=4,
               per_device_train_batch_size=8, gradient_accumulation_steps=1, router_aux_loss_coef=coef)
    make_trainer(config_from_dict(cfg)).train()
    rows = _metrics(tmp_path / "out")
    assert "router_aux_loss" in rows[0], sorted(rows[0])
    assert rows[0]["loss"] == pytest.approx(math.log(2) + coef * rows[0]["router_aux_loss"], abs=1e-5)
    assert rows[-1]["loss"] - coef * rows[-1]["router_aux_loss"] < math.log(2)


# family -> targets its exported adapter must have beside q_proj (PEFT's names: its second stack's projections)
HYBRID_TARGETS = {"qwen3_5_text": {"in_proj_qkv", "out_proj"}, "lfm2": {"conv.in_proj", "conv.out_proj"}}


@pytest.mark.parametrize("family", sorted(HYBRID_TARGETS))
def test_lora_dpo_on_a_hybrid_learns_through_its_deltanet_layers(tmp_path, family):
    """LoRA DPO (all-linear: the second stack's projections carry adapters: Qwen3.5's Gated DeltaNet, LFM2's short
    conv) on a hybrid of the fixture's architecture: step 1's loss is ln 2 (the reference is the adapter-free
    policy) and, every step seeing all 24 pairs, the loss goes down; the exported adapter has those targets."""
    base = write_hybrid_model(tmp_path / "hybrid", family=family)
    cfg = _cfg(tmp_path, trainer="dpo", model=str(base), lora=True, lora_rank=4, lora_alpha=8,
               lora_target_modules="all-linear", max_steps=3, per_device_train_batch_size=24,
               gradient_accumulation_steps=1)
    make_trainer(config_from_dict(cfg)).train()
    rows = _metrics(tmp_path / "out")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.02 and rows[-1]["rewards/margins"] > 0, rows
    targets = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert {"q_proj", *HYBRID_TARGETS[family]} <= set(targets), targets
