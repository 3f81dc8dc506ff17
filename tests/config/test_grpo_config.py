"""GRPO config keys: TRL's defaults, read under `trainer: grpo`, refused (naming the key) under another trainer."""
from __future__ import annotations

import pytest

from surojax.config import ConfigError, config_from_dict
from surojax.config.policy_loss import resolved_beta, resolved_loss_type

BASE = {"model": "m", "datasets": [{"path": "d.jsonl"}]}
GRPO = {**BASE, "trainer": "grpo", "reward_functions": ["exact_match"]}


def problems(d: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    return {p.key: str(e.value) for p in e.value.problems}


def test_defaults_are_trls():
    cfg = config_from_dict(GRPO)
    assert (cfg.num_generations, cfg.max_completion_length, cfg.temperature, cfg.top_p) == (8, 256, 1.0, 1.0)
    assert (resolved_beta(cfg), cfg.epsilon, cfg.clip_high, resolved_loss_type(cfg), cfg.num_iterations) == (
        0.0, 0.2, 0.2, "dapo", 1)
    assert (cfg.scale_rewards, cfg.reward_weights, cfg.mask_truncated_completions) == ("group", None, False)
    assert config_from_dict({**GRPO, "epsilon_high": 0.28}).clip_high == 0.28


def test_grpo_keys_refused_under_sft():
    got = problems({**BASE, "beta": 0.04, "loss_type": "grpo", "reward_functions": ["exact_match"]})
    assert set(got) == {"beta", "loss_type", "reward_functions"}
    assert "applies with trainer: dpo or grpo (this run's trainer is sft)" in got["beta"]
    assert "is a GRPO option; it does not apply to trainer: sft" in got["reward_functions"]


def test_loss_type_of_the_other_trainer_is_refused():
    assert "not a grpo loss type" in problems({**GRPO, "loss_type": "sigmoid"})["loss_type"]
    dpo = {**BASE, "trainer": "dpo", "datasets": [{"path": "d.jsonl", "type": "preference"}]}
    assert "not a dpo loss type" in problems({**dpo, "loss_type": "dapo"})["loss_type"]
    assert resolved_beta(config_from_dict(dpo)) == 0.1 and resolved_loss_type(config_from_dict(dpo)) == "sigmoid"


def test_grpo_cross_field_rules():
    assert "at least one reward function" in problems({**BASE, "trainer": "grpo"})["reward_functions"]
    assert "one weight per reward function" in problems({**GRPO, "reward_weights": [1.0, 2.0]})["reward_weights"]
    assert "needs the pattern" in problems({**GRPO, "reward_functions": ["format_regex"]})["format_regex"]
    assert "add format_regex" in problems({**GRPO, "format_regex": "x"})["format_regex"]
    assert "not a valid regular expression" in problems({**GRPO, "reward_functions": ["format_regex"],
                                                         "format_regex": "("})["format_regex"]
    assert "neither a built-in" in problems({**GRPO, "reward_functions": ["nocolon"]})["reward_functions"]
    assert "num_generations" in problems({**GRPO, "num_generations": 1})
