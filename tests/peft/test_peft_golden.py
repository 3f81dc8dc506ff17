"""Golden fixture from PEFT itself (scripts/make_peft_fixtures.py): our loader on PEFT's files gives PEFT's logits."""
from __future__ import annotations

import json

import numpy as np
import pytest

from peft_support import FIXTURES
from surojax.peft.lora import LORA_TARGETS, lora_modules
from surojax.peft.peft_io import load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile

EXPECTED = np.load(FIXTURES / "expected.npz")


def test_fixture_base_matches_transformers():
    """The fixture itself: our base model gives transformers' base logits (so the adapter test isolates LoRA)."""
    model = load_model(FIXTURES / "base")
    np.testing.assert_allclose(model(EXPECTED["tokens"]), EXPECTED["base_logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("trainable", [True, False])
def test_peft_adapter_gives_peft_logits(trainable):
    spec = load_peft_adapter(FIXTURES / "adapter").spec
    assert (spec.rank, spec.alpha, spec.use_rslora, spec.targets) == (4, 8.0, False, LORA_TARGETS)
    model = load_adapter_into(load_model(FIXTURES / "base"), FIXTURES / "adapter", trainable=trainable)
    assert bool(lora_modules(model)) == trainable
    got = np.asarray(model(EXPECTED["tokens"]))
    assert np.abs(EXPECTED["logits"] - EXPECTED["base_logits"]).max() > 0.1  # the adapter matters
    np.testing.assert_allclose(got, EXPECTED["logits"], rtol=0, atol=1e-4)  # fp32, different op order than torch


def test_resaving_reproduces_peft_files(tmp_path):
    model = load_adapter_into(load_model(FIXTURES / "base"), FIXTURES / "adapter", trainable=True)
    out = save_peft_adapter(model, tmp_path / "again", "tests/fixtures/peft/base")
    ours, theirs = SafetensorsFile(out / "adapter_model.safetensors"), SafetensorsFile(
        FIXTURES / "adapter" / "adapter_model.safetensors")
    assert sorted(ours.names()) == sorted(theirs.names())
    assert all(np.array_equal(ours.get(n), theirs.get(n)) for n in theirs.names())
    a = json.loads((out / "adapter_config.json").read_text())
    b = json.loads((FIXTURES / "adapter" / "adapter_config.json").read_text())
    keys = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora",
            "use_dora", "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert sorted(a["target_modules"]) == sorted(b["target_modules"])
