"""Expert adapters of the MoE families whose experts module is not `mlp.experts`, in PEFT's layout: Gemma 4's MoE
block (`model.layers.{i}.experts`) and LFM2-MoE (`model.layers.{i}.feed_forward.experts`, after dense leading
layers, in conv and attention layers).

The fixtures (tests/fixtures/peft/gemma4_moe, lfm2_moe; scripts/make_peft_fixtures.py, transformers 5.17 + peft
0.21): PEFT's own adapter (q_proj, v_proj and both fused expert parameters through target_parameters, every A and B
random) on the parity checkpoints, and the logits PEFT computes with it. Read into our model the adapter gives
PEFT's logits, trained or merged; written back by us it is PEFT's files (names, values, target_parameters), so PEFT
loads our export into the same numbers.
"""
from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from peft_support import FIXTURES, forward
from surojax.peft.lora import lora_modules, merge_lora
from surojax.peft.peft_io import AdapterError, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile

MODELS = FIXTURES.parent / "models"
CASES = {"gemma4_moe": ("gemma4_text_moe", "experts"), "lfm2_moe": ("lfm2_moe_dense", "feed_forward.experts")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_peft_expert_adapter_gives_peft_logits_trained_and_merged(name):
    base, _ = CASES[name]
    expected = np.load(FIXTURES / name / "expected.npz")
    tokens = jnp.asarray(expected["tokens"])
    assert np.abs(expected["logits"] - expected["base_logits"]).max() > 0.5  # the adapter matters
    model = load_adapter_into(load_model(MODELS / base, dtype=jnp.float32, attention="xla"),
                              FIXTURES / name / "adapter", trainable=True)
    assert {k for k in lora_modules(model) if "experts" in k}  # the expert adapters are live LoRAExpertLinears
    np.testing.assert_allclose(np.asarray(forward(model, tokens)), expected["logits"], rtol=0, atol=1e-4)
    merge_lora(model)  # W[e] += s * A[e] @ B[e] in every stack
    assert not lora_modules(model)
    np.testing.assert_allclose(np.asarray(forward(model, tokens)), expected["logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_our_export_is_peft_files(tmp_path, name):
    base, module = CASES[name]
    theirs_dir = FIXTURES / name / "adapter"
    model = load_adapter_into(load_model(MODELS / base, dtype=jnp.float32, attention="xla"), theirs_dir,
                              trainable=True)
    out = save_peft_adapter(model, tmp_path / "again", MODELS / base)
    ours, theirs = SafetensorsFile(out / "adapter_model.safetensors"), SafetensorsFile(
        theirs_dir / "adapter_model.safetensors")
    assert sorted(ours.names()) == sorted(theirs.names())
    assert all(np.array_equal(ours.get(n), theirs.get(n)) for n in theirs.names())
    a = json.loads((out / "adapter_config.json").read_text())
    b = json.loads((theirs_dir / "adapter_config.json").read_text())
    assert a["target_parameters"] == b["target_parameters"] == [f"{module}.gate_up_proj", f"{module}.down_proj"]
    keys = ("target_modules", "peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_another_familys_expert_parameters_are_refused(tmp_path):
    """LFM2-MoE's adapter with qwen's `mlp.experts` entries (peft would match no parameter) is refused by name."""
    bad = tmp_path / "adapter"
    shutil.copytree(FIXTURES / "lfm2_moe" / "adapter", bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    model = load_model(MODELS / "lfm2_moe_dense", dtype=jnp.float32, attention="xla")
    with pytest.raises(AdapterError, match=r"'mlp.experts.gate_up_proj' matches no parameter of this model.*"
                                           r"model.layers.\{i\}.feed_forward.experts.gate_up_proj"):
        load_adapter_into(model, bad, trainable=True)
