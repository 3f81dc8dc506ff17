"""Stacked LoRA: adapter_init_mode merge (fold the old adapter, train a fresh one) and trainable (continue it)."""
from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from peft_support import TOKENS, randomize_adapter, tiny_model
from surojax.peft.lora import FROZEN, TRAINABLE, apply_lora, lora_modules, merge_lora
from surojax.peft.peft_io import save_peft_adapter
from surojax.peft.stacked import init_lora, load_adapter_into


def _flat(state):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


@pytest.fixture
def old(tmp_path):
    """An existing adapter (rank 2, alpha 4, attention only) and the logits of base + it."""
    model = apply_lora(tiny_model(), targets=["q_proj", "k_proj", "v_proj", "o_proj"], rank=2, alpha=4.0,
                       rngs=nnx.Rngs(5))
    randomize_adapter(model, seed=11, scale=0.2)
    return save_peft_adapter(model, tmp_path / "old", None), model(TOKENS)


def test_merge_mode_folds_the_old_adapter_and_adds_a_fresh_one(old):
    path, want = old
    model = init_lora(tiny_model(), rank=4, alpha=8.0, rngs=nnx.Rngs(0), adapter_path=path)  # merge by default
    mods = lora_modules(model)
    assert tuple(mods) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert all(m.rank == 4 and not jnp.any(m.lora_b[...]) for m in mods.values())  # fresh: B = 0
    np.testing.assert_allclose(model(TOKENS), want, rtol=0, atol=1e-5)  # base + old, folded (rounding only)
    base = _flat(nnx.state(tiny_model(), nnx.Param))
    frozen = _flat(nnx.state(model, FROZEN))
    assert not np.array_equal(frozen["layers.attn.q_proj.base.kernel"], base["layers.attn.q_proj.kernel"])
    assert np.array_equal(frozen["layers.mlp.up_proj.base.kernel"], base["layers.mlp.up_proj.kernel"])
    # Training on top and merging again gives a plain model that carries both adapters.
    randomize_adapter(model, seed=3)
    both = model(TOKENS)
    np.testing.assert_allclose(merge_lora(model)(TOKENS), both, rtol=0, atol=1e-5)


def test_trainable_mode_continues_the_adapter_as_saved(old, caplog):
    path, want = old
    with caplog.at_level(logging.WARNING):
        model = init_lora(tiny_model(), rank=16, alpha=32.0, dropout=0.1, rngs=nnx.Rngs(0), adapter_path=path,
                          adapter_init_mode="trainable")
    assert "continuing the adapter as saved" in caplog.text
    mods = lora_modules(model)
    assert tuple(mods) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all((m.rank, m.alpha, m.dropout) == (2, 4.0, 0.1) for m in mods.values())
    assert jnp.array_equal(model(TOKENS), want)  # eval mode: exactly base + old adapter
    assert all(jnp.any(v) for k, v in _flat(nnx.state(model, TRAINABLE)).items() if k.endswith("lora_b"))
    base = _flat(nnx.state(tiny_model(), nnx.Param))
    frozen = _flat(nnx.state(model, FROZEN))
    assert np.array_equal(frozen["layers.attn.q_proj.base.kernel"], base["layers.attn.q_proj.kernel"])


def test_fold_under_a_live_adapter_and_mode_errors(old):
    path, want = old
    model = apply_lora(tiny_model(), rank=4, alpha=8.0, rngs=nnx.Rngs(0))
    load_adapter_into(model, path, trainable=False)  # folds into the base under the current (B = 0) adapter
    np.testing.assert_allclose(model(TOKENS), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        load_adapter_into(model, path, trainable=True)
    with pytest.raises(ValueError, match="adapter_init_mode 'stack' is unknown"):
        init_lora(tiny_model(), rank=4, alpha=8.0, rngs=nnx.Rngs(0), adapter_path=path, adapter_init_mode="stack")
