"""PEFT's own LoRA on Gemma 3 and Gemma 4 text (scripts/make_peft_fixtures.py, `gemma3` / `gemma4`: "all-linear",
i.e. q/k/v/o and the GeGLU's gate/up/down, over the parity fixtures tests/fixtures/models/gemma{3,4}_text: sliding
and global layers with their own ropes, sandwich norms, scaled embeddings; Gemma 4's v norm and layer scalars):
PEFT's adapter gives PEFT's logits in our model, plain SGD
on the adapter follows PEFT's loss curve step by step, and the trained adapter saves under PEFT's own names and
target modules and loads back into a fresh model with the same loss. One compiled value-and-gradient program."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.peft.lora import TRAINABLE, lora_modules
from surojax.peft.peft_io import WEIGHTS_FILE, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_peft_adapter_logits_sgd_curve_and_export(name, tmp_path):
    fixture = ROOT / "tests" / "fixtures" / "peft" / name
    base = ROOT / "tests" / "fixtures" / "models" / f"{name}_text"
    expected = np.load(fixture / "expected.npz")
    model = load_adapter_into(load_model(base, dtype=jnp.float32, attention="xla"), fixture / "adapter",
                              trainable=True)
    assert set(lora_modules(model)) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    tokens = jnp.asarray(expected["tokens"])
    graphdef, trainable, rest = nnx.split(model, TRAINABLE, ...)

    def loss_fn(tr):  # transformers' causal-LM loss: mean next-token cross-entropy; the logits beside it
        logits = nnx.merge(graphdef, tr, rest)(tokens)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], axis=-1)
        return jnp.mean(nll), logits

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    lr, steps = float(expected["lr"]), len(expected["losses"]) - 1
    losses = []
    for i in range(steps + 1):
        (loss, logits), grads = step(trainable)
        losses.append(float(loss))
        if i == 0:
            np.testing.assert_allclose(np.asarray(logits), expected["logits"], rtol=0, atol=1e-4)
            flat = [g.get_value() for _, g in nnx.to_flat_state(grads)]
            assert len(flat) == 2 * 7 and all(np.abs(np.asarray(g)).max() > 0 for g in flat)
        if i < steps:
            trainable = jax.tree.map(lambda p, g: p - lr * g, trainable, grads)
    assert np.all(np.diff(expected["losses"]) < -0.02)  # the curve moves, every step
    np.testing.assert_allclose(losses, expected["losses"], rtol=1e-5, atol=0)

    trained = nnx.merge(graphdef, trainable, rest)
    out = save_peft_adapter(trained, tmp_path / "adapter", str(base))
    assert set(SafetensorsFile(out / WEIGHTS_FILE).names()) == set(
        SafetensorsFile(fixture / "adapter" / WEIGHTS_FILE).names())
    config = json.loads((out / "adapter_config.json").read_text())
    peft_config = json.loads((fixture / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(peft_config["target_modules"])
    fresh = load_adapter_into(load_model(base, dtype=jnp.float32, attention="xla"), out, trainable=True)
    assert nnx.split(fresh)[0] == graphdef
    np.testing.assert_allclose(float(step(nnx.state(fresh, TRAINABLE))[0][0]), losses[-1], atol=1e-6, rtol=0)
