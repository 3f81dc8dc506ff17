"""LoRA on a MoE model: per-expert adapters through the grouped GEMM, PEFT's target_parameters layout, merge.

The golden fixture (tests/fixtures/peft/moe, made by scripts/make_peft_fixtures.py with transformers 5 + peft 0.21):
a tiny Qwen3-MoE, a PEFT adapter on q_proj, v_proj and the fused experts, and the logits PEFT computes with it.
"""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from peft_support import FIXTURES, forward, randomize_adapter
from surojax.models.config import ModelConfig, MoEConfig
from surojax.models.decoder import Decoder
from surojax.peft.lora import LoRAExpertLinear, apply_lora, lora_modules, merge_lora, resolve_targets
from surojax.peft.peft_io import load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile

MOE = FIXTURES / "moe"
EXPECTED = np.load(MOE / "expected.npz")
TINY_MOE = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                       moe=MoEConfig(4, 2, 16, norm_topk_prob=True))
TOKENS = jnp.array([[1, 5, 9, 33, 2, 17, 60, 8], [4, 4, 21, 0, 63, 12, 7, 30]], jnp.int32)
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def test_moe_target_names():
    assert resolve_targets("all-linear", moe=True) == ("q_proj", "k_proj", "v_proj", "o_proj") + EXPERTS
    # the default list of the seven HF names means the same on a MoE model: gate + up are the fused gate_up
    assert resolve_targets(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                           moe=True) == resolve_targets("all-linear", moe=True)
    assert resolve_targets(["v_proj", "experts"], moe=True) == ("v_proj",) + EXPERTS
    assert resolve_targets(["down_proj"], moe=True) == ("experts.down_proj",)
    assert resolve_targets(["gate_up_proj", "q_proj"], moe=True) == ("q_proj", "experts.gate_up_proj")
    with pytest.raises(ValueError, match="fused"):
        resolve_targets(["gate_proj"], moe=True)
    with pytest.raises(ValueError, match="not valid"):
        resolve_targets(["experts"])  # a dense model has no experts


def test_expert_dropout_is_refused():
    with pytest.raises(ValueError, match="ParamWrapper"):
        apply_lora(Decoder(TINY_MOE, rngs=nnx.Rngs(0)), targets=["experts"], rank=2, alpha=4, dropout=0.1,
                   rngs=nnx.Rngs(1))


def test_fresh_adapter_is_exact_identity_then_merge_equals_adapter():
    model = Decoder(TINY_MOE, rngs=nnx.Rngs(0))
    base = np.asarray(forward(model, TOKENS))
    apply_lora(model, targets=["q_proj", "v_proj", "experts"], rank=3, alpha=6, rngs=nnx.Rngs(1))
    mods = lora_modules(model)
    assert isinstance(mods["experts.gate_up_proj"], LoRAExpertLinear)
    assert mods["experts.gate_up_proj"].lora_a.get_value().shape == (2, 4, 32, 3)  # [L, E, D, R]
    assert mods["experts.down_proj"].lora_b.get_value().shape == (2, 4, 3, 32)  # [L, E, R, D]
    np.testing.assert_array_equal(np.asarray(forward(model, TOKENS)), base)  # B = 0
    randomize_adapter(model)
    with_adapter = np.asarray(forward(model, TOKENS))
    assert np.abs(with_adapter - base).max() > 1e-2
    merge_lora(model)  # folds W[e] += s * A[e] @ B[e] and puts the plain ExpertLinear back
    assert not lora_modules(model)
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), with_adapter, rtol=0, atol=2e-5)


def test_moe_fixture_base_matches_transformers():
    model = load_model(MOE / "base")
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(EXPECTED["tokens"]))), EXPECTED["base_logits"],
                               rtol=0, atol=1e-4)


def test_peft_adapter_layout_is_read():
    spec = load_peft_adapter(MOE / "adapter").spec
    assert (spec.rank, spec.alpha, spec.targets) == (4, 8.0, ("q_proj", "v_proj") + EXPERTS)


@pytest.mark.parametrize("trainable", [True, False])
def test_peft_moe_adapter_gives_peft_logits(trainable):
    """trainable: LoRAExpertLinear on the grouped rows; not trainable: folded into the expert kernels (merge)."""
    model = load_adapter_into(load_model(MOE / "base"), MOE / "adapter", trainable=trainable)
    assert bool(lora_modules(model)) == trainable
    assert np.abs(EXPECTED["logits"] - EXPECTED["base_logits"]).max() > 0.1  # the adapter matters
    # the jitted forward: the folded model (not trainable) shares the plain base's compilation
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(EXPECTED["tokens"]))), EXPECTED["logits"], rtol=0,
                               atol=1e-4)


def test_resaving_reproduces_peft_files(tmp_path):
    """Our export of PEFT's adapter is PEFT's layout: the same tensor names, shapes and values, same targets."""
    model = load_adapter_into(load_model(MOE / "base"), MOE / "adapter", trainable=True)
    out = save_peft_adapter(model, tmp_path / "again", MOE / "base")
    ours, theirs = SafetensorsFile(out / "adapter_model.safetensors"), SafetensorsFile(
        MOE / "adapter" / "adapter_model.safetensors")
    assert sorted(ours.names()) == sorted(theirs.names())
    assert all(np.array_equal(ours.get(n), theirs.get(n)) for n in theirs.names())
    a = json.loads((out / "adapter_config.json").read_text())
    b = json.loads((MOE / "adapter" / "adapter_config.json").read_text())
    assert sorted(a["target_modules"]) == sorted(b["target_modules"])
    assert a["target_parameters"] == b["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    keys = ("peft_type", "r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora", "use_dora")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


@pytest.mark.parametrize("targets", [["experts"], ["down_proj"]])
def test_trained_adapter_round_trips(tmp_path, targets):
    """A trained (random) expert adapter: saved in PEFT's layout, loaded back by our loader, same logits. One
    expert target alone has no `.base_layer` segment; both targets nest gate_up_proj's inside."""
    model = Decoder(TINY_MOE, rngs=nnx.Rngs(0))
    apply_lora(model, targets=["q_proj"] + targets, rank=2, alpha=4, rngs=nnx.Rngs(1))
    randomize_adapter(model)
    want = np.asarray(forward(model, TOKENS))
    out = save_peft_adapter(model, tmp_path / "a", None)
    names = SafetensorsFile(out / "adapter_model.safetensors").names()
    nested = [n for n in names if ".base_layer." in n]
    assert len(nested) == (4 if targets == ["experts"] else 0)
    fresh = Decoder(TINY_MOE, rngs=nnx.Rngs(0))
    load_adapter_into(fresh, out, trainable=True)
    np.testing.assert_allclose(np.asarray(forward(fresh, TOKENS)), want, rtol=0, atol=1e-6)
