"""The DPO loss against a golden file made with transformers + peft (scripts/make_dpo_fixtures.py): the pairs'
token ids, the per-sequence response log-prob sums of the policy (base + LoRA adapter) and of the reference (the
adapter disabled), the loss of each loss_type, and torch's gradient w.r.t. one adapter's A and B."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.config.data import DatasetSpec
from surojax.data.preference import PairFormatter, PreferenceRows
from surojax.data.tokenizer import Tokenizer
from surojax.losses.dpo import DPOSettings, dpo_loss, sequence_logps
from surojax.peft.lora import adapters_disabled
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model

from tests.train.conftest import ROOT

BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3"
FIXTURES = ROOT / "tests" / "fixtures" / "dpo"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())
LORA_REFERENCE = {"without_adapter": adapters_disabled}  # the base is the reference
SETTINGS = {"sigmoid": DPOSettings(beta=GOLDEN["beta"]),
            "sigmoid_ls": DPOSettings(beta=GOLDEN["beta"], label_smoothing=0.1),
            "hinge": DPOSettings(beta=GOLDEN["beta"], loss_type="hinge"),
            "ipo": DPOSettings(beta=GOLDEN["beta"], loss_type="ipo")}


@pytest.fixture(scope="module")
def pairs():
    fmt = PairFormatter(Tokenizer.from_dir(BASE), DatasetSpec(path="-", type="preference"))
    return [fmt(row) for row in GOLDEN["rows"]]


@pytest.fixture(scope="module")
def policy():
    return load_adapter_into(load_model(BASE), FIXTURES / "adapter", trainable=True)


def _batch(pairs):
    rows = PreferenceRows(pairs, 32)
    return {k: jnp.asarray(np.stack([rows[i][k] for i in range(len(rows))])) for k in
            ("tokens", "positions", "segment_ids", "targets", "loss_mask")}  # [P, 2, T]


def test_pairs_tokenize_as_transformers(pairs):
    got = [[p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()] for p in pairs]
    assert got == GOLDEN["pairs"]


def test_log_probs_and_losses_equal_transformers(pairs, policy):
    batch = _batch(pairs)
    np.testing.assert_allclose(sequence_logps(policy, batch, chunk=16), GOLDEN["policy_logps"], rtol=1e-5, atol=1e-4)
    with adapters_disabled(policy):
        np.testing.assert_allclose(sequence_logps(policy, batch), GOLDEN["reference_logps"], rtol=1e-5, atol=1e-4)
    for name, settings in SETTINGS.items():
        total, aux = dpo_loss(policy, batch, settings=settings, chunk=16, **LORA_REFERENCE)
        assert float(aux["tokens"]) == 3
        np.testing.assert_allclose(float(total) / 3, GOLDEN["losses"][name], rtol=1e-5, atol=1e-4, err_msg=name)


def test_gradient_equals_torch(pairs, policy):
    batch = _batch(pairs)
    graphdef, lora, rest = nnx.split(policy, nnx.LoRAParam, ...)

    def mean_loss(lora_state):
        total, aux = dpo_loss(nnx.merge(graphdef, lora_state, rest), batch, settings=SETTINGS["sigmoid"],
                              **LORA_REFERENCE)
        return total / aux["tokens"]

    grads = jax.grad(mean_loss)(lora)
    q = grads["layers"]["attn"]["q_proj"]
    want = GOLDEN["grad_q_proj_layer0"]
    # ours: A [L, in, R], B [L, R, out]; torch: A [R, in], B [out, R]
    np.testing.assert_allclose(np.asarray(q["lora_a"][...][0]), np.asarray(want["lora_A"]).T, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(q["lora_b"][...][0]), np.asarray(want["lora_B"]).T, rtol=1e-3, atol=1e-6)
    assert np.abs(np.asarray(want["lora_B"])).max() > 1e-4  # a gradient that can be wrong
