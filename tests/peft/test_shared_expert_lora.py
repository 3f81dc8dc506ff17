"""LoRA on a MoE model's shared expert (qwen2_moe): target names, PEFT's adapter read and written, one gradient.

The golden fixture (tests/fixtures/peft/shared_expert, scripts/make_peft_fixtures.py, transformers 5 + peft 0.21): a
tiny Qwen2-MoE, a PEFT adapter whose bare target_modules gate_proj / up_proj / down_proj PEFT matched to the shared
expert's modules (plus q_proj, v_proj and the routed experts by target_parameters), PEFT's logits with it, and the
causal-LM loss's gradient for every shared-expert LoRA tensor.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from peft_support import FIXTURES, forward
from surojax.models.registry import weight_rows
from surojax.models.targets import resolve_targets
from surojax.peft.lora import TRAINABLE, LoRALinear, apply_lora, lora_modules
from surojax.peft.peft_io import AdapterError, load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile

SHARED = FIXTURES / "shared_expert"
EXPECTED = np.load(SHARED / "expected.npz")
TOKENS = jnp.asarray(EXPECTED["tokens"])
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
SHARED_TARGETS = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")


def test_shared_expert_target_names():
    assert resolve_targets("all-linear", moe=True, shared_expert=True) == ATTN + EXPERTS + SHARED_TARGETS
    assert resolve_targets(["q_proj", "shared_expert"], moe=True, shared_expert=True) == ("q_proj",) + SHARED_TARGETS
    assert resolve_targets(["shared_expert.up_proj", "down_proj"], moe=True, shared_expert=True) == (
        "experts.down_proj", "shared_expert.up_proj")  # a bare down_proj stays the routed experts' (as before)
    with pytest.raises(ValueError, match="no shared expert"):
        resolve_targets(["shared_expert"], moe=True)
    with pytest.raises(ValueError, match="not valid"):
        resolve_targets(["shared_expert.gate_proj"])  # a dense model


def test_peft_adapter_is_read_as_peft_applied_it():
    """PEFT's bare gate/up/down_proj on Qwen2-MoE wrapped the shared expert (the routed experts are parameters)."""
    model = load_model(SHARED / "base")
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), EXPECTED["base_logits"], rtol=0, atol=1e-4)
    adapter = load_peft_adapter(SHARED / "adapter", rows=tuple(weight_rows(model.cfg)))
    assert adapter.spec.targets == ("q_proj", "v_proj") + SHARED_TARGETS + EXPERTS
    assert adapter.weights["shared_expert.down_proj"][0].shape == (2, 24, 4)  # [L, Fs, R]


@pytest.mark.parametrize("trainable", [True, False])
def test_peft_adapter_gives_peft_logits(trainable):
    """trainable: LoRALinears on the shared expert (and the experts' grouped adapters); not: folded into the base."""
    model = load_adapter_into(load_model(SHARED / "base"), SHARED / "adapter", trainable=trainable)
    mods = lora_modules(model)
    assert bool(mods) == trainable
    if trainable:
        assert isinstance(mods["shared_expert.gate_proj"], LoRALinear)
    assert np.abs(EXPECTED["logits"] - EXPECTED["base_logits"]).max() > 0.1  # the adapter matters
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), EXPECTED["logits"], rtol=0, atol=1e-4)


def test_resaving_reproduces_peft_tensors_under_names_peft_matches(tmp_path):
    model = load_adapter_into(load_model(SHARED / "base"), SHARED / "adapter", trainable=True)
    out = save_peft_adapter(model, tmp_path / "again", SHARED / "base")
    ours, theirs = (SafetensorsFile(d / "adapter_model.safetensors") for d in (out, SHARED / "adapter"))
    assert sorted(ours.names()) == sorted(theirs.names())
    assert all(np.array_equal(ours.get(n), theirs.get(n)) for n in theirs.names())
    cfg = json.loads((out / "adapter_config.json").read_text())
    # unambiguous names (PEFT matches `...mlp.shared_expert.gate_proj` by its end); read back to the same targets
    assert cfg["target_modules"] == ["q_proj", "v_proj", *SHARED_TARGETS]
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    again = load_adapter_into(load_model(SHARED / "base"), out, trainable=False)
    np.testing.assert_allclose(np.asarray(forward(again, TOKENS)), EXPECTED["logits"], rtol=0, atol=1e-4)


def _loss(model, tokens):
    """transformers' causal-LM loss: mean next-token cross-entropy."""
    logits = model(tokens)[:, :-1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_one_gradient_step_on_the_shared_expert_equals_peft():
    """The loss and its gradient for every shared-expert LoRA tensor equal what torch + PEFT computed; a step along
    it lowers the loss."""
    model = load_adapter_into(load_model(SHARED / "base"), SHARED / "adapter", trainable=True)
    graphdef, params, rest = nnx.split(model, TRAINABLE, ...)

    def loss_fn(p):
        return _loss(nnx.merge(graphdef, p, rest), TOKENS)

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))  # one program for both losses
    loss, grads = value_and_grad(params)
    np.testing.assert_allclose(float(loss), float(EXPECTED["loss"]), rtol=1e-5)
    for target in SHARED_TARGETS:
        g = grads["layers"]["mlp"]["shared_expert"][target.split(".")[1]]
        ga, gb = np.asarray(g["lora_a"].get_value()), np.asarray(g["lora_b"].get_value())  # [L, in, R], [L, R, out]
        for i in range(2):
            name = f"grad:model.layers.{i}.mlp.{target}.lora_"
            for ours, theirs in ((ga[i].T, EXPECTED[name + "A.weight"]), (gb[i].T, EXPECTED[name + "B.weight"])):
                scale = np.abs(theirs).max()
                assert scale > 0 and np.abs(ours - theirs).max() <= 1e-4 * scale, (name, np.abs(ours - theirs).max())
    stepped = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    assert float(value_and_grad(stepped)[0]) < float(loss)


def test_apply_lora_wraps_the_shared_expert_only_where_asked():
    model = load_model(SHARED / "base")
    apply_lora(model, targets=["shared_expert"], rank=2, alpha=4, rngs=nnx.Rngs(1))
    assert set(lora_modules(model)) == set(SHARED_TARGETS)
    assert model.layers.mlp.shared_expert.down_proj.lora_a.get_value().shape == (2, 24, 2)  # [L, Fs, R]
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), EXPECTED["base_logits"], rtol=0, atol=1e-4)


def test_bare_mlp_names_on_a_moe_model_without_shared_expert_are_refused():
    """The same adapter for a Qwen3-MoE (no shared expert, no dense MLP): its bare gate/up/down_proj match nothing."""
    rows = tuple(weight_rows(load_model(FIXTURES / "moe" / "base").cfg))
    with pytest.raises(AdapterError, match=r"target_modules \['gate_proj', 'up_proj', 'down_proj'\] name modules "
                                           "this model does not have"):
        load_peft_adapter(SHARED / "adapter", rows=rows)
