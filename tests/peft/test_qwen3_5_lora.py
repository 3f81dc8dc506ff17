"""PEFT's own LoRA on Qwen3.5 (scripts/make_peft_fixtures.py, `qwen3_5`: "all-linear" over the parity fixture
tests/fixtures/models/qwen3_5_text, so the Gated DeltaNet projections carry adapters too): PEFT's adapter gives
PEFT's logits in our model, and plain SGD on the adapter follows PEFT's loss curve step by step."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.peft.lora import TRAINABLE, lora_modules
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "peft" / "qwen3_5"
BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3_5_text"
EXPECTED = np.load(FIXTURE / "expected.npz")


@pytest.fixture(scope="module")
def model():
    return load_adapter_into(load_model(BASE, dtype=jnp.float32, attention="xla"), FIXTURE / "adapter",
                             trainable=True)


def test_peft_adapter_on_every_stack_gives_peft_logits(model):
    assert {"linear_layers.in_proj_qkv", "linear_layers.out_proj", "q_proj", "gate_proj",
            "linear_layers.gate_proj"} <= set(lora_modules(model))
    got = np.asarray(model(jnp.asarray(EXPECTED["tokens"])))
    np.testing.assert_allclose(got, EXPECTED["logits"], rtol=0, atol=1e-4)


def test_sgd_on_the_adapter_follows_peft_loss_curve(model):
    tokens = jnp.asarray(EXPECTED["tokens"])
    graphdef, trainable, rest = nnx.split(model, TRAINABLE, ...)

    def loss_fn(tr):  # transformers' causal-LM loss: mean next-token cross-entropy
        logits = nnx.merge(graphdef, tr, rest)(tokens)[:, :-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    step = jax.jit(jax.value_and_grad(loss_fn))
    lr = float(EXPECTED["lr"])
    losses = []
    for _ in range(len(EXPECTED["losses"]) - 1):
        loss, grads = step(trainable)
        losses.append(float(loss))
        trainable = jax.tree.map(lambda p, g: p - lr * g, trainable, grads)
    losses.append(float(jax.jit(loss_fn)(trainable)))
    assert np.all(np.diff(EXPECTED["losses"]) < -0.02)  # the curve moves, every step
    np.testing.assert_allclose(losses, EXPECTED["losses"], rtol=2e-6, atol=0)
