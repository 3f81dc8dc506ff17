"""MoE checkpoints: save_model writes the published per-expert names; load_model reads them and transformers 5's
fused expert names (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]) to the same model."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.weights.hf_checkpoint import hf_tensors, load_model, save_model
from surojax.weights.safetensors_file import WeightsError, write_safetensors

BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False)
HF = {
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      norm_topk_prob=True),
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=8),
}
PREFIX = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def random_model(family: str) -> Decoder:
    return Decoder(ModelConfig.from_hf(HF[family]), rngs=nnx.Rngs(3))


def params(model) -> dict:
    return {k: np.asarray(v) for k, v in hf_tensors(model).items()}


@pytest.mark.parametrize("family", HF)
def test_save_writes_per_expert_names_and_loads_back(tmp_path, family):
    model = random_model(family)
    save_model(model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["num_experts_per_tok"] == 2
    t = params(model)
    gate, up, down = NAMES[family]
    p = f"model.layers.1.{PREFIX[family]}"
    assert t[f"{p}.experts.3.{gate}.weight"].shape == (8, 16)  # torch Linear [out, in]
    assert t[f"{p}.experts.3.{down}.weight"].shape == (16, 8)
    assert t[f"{p}.gate.weight"].shape == (4, 16)
    # the fused state: gate is the first half, up the second
    k = np.asarray(model.layers.mlp.experts.gate_up_proj.kernel[...])  # [L, E, D, 2F]
    np.testing.assert_array_equal(t[f"{p}.experts.3.{gate}.weight"], k[1, 3, :, :8].T)
    np.testing.assert_array_equal(t[f"{p}.experts.3.{up}.weight"], k[1, 3, :, 8:].T)
    back = load_model(tmp_path / "m")
    for name, value in params(back).items():
        np.testing.assert_array_equal(value, t[name], err_msg=name)
    tokens = jnp.asarray([[1, 5, 9, 2, 7]])
    np.testing.assert_allclose(back(tokens), model(tokens), rtol=1e-6)


@pytest.mark.parametrize("family", HF)
def test_transformers5_fused_names_load(tmp_path, family):
    model = random_model(family)
    t = params(model)
    gate, up, down = NAMES[family]
    fused = {n: v for n, v in t.items() if ".experts." not in n and ".gate.weight" not in n}
    for i in range(2):
        p = f"model.layers.{i}.{PREFIX[family]}"
        fused[f"model.layers.{i}.mlp.gate.weight"] = t[f"{p}.gate.weight"]
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([t[f"{p}.experts.{e}.{gate}.weight"], t[f"{p}.experts.{e}.{up}.weight"]]) for e in range(4)])
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(
            [t[f"{p}.experts.{e}.{down}.weight"] for e in range(4)])
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF[family]))
    write_safetensors(d / "model.safetensors", fused)
    for name, value in params(load_model(d)).items():
        np.testing.assert_array_equal(value, t[name], err_msg=name)


def test_missing_expert_is_named(tmp_path):
    model = random_model("qwen3_moe")
    t = params(model)
    del t["model.layers.0.mlp.experts.2.up_proj.weight"]
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF["qwen3_moe"]))
    write_safetensors(d / "model.safetensors", t)
    with pytest.raises(WeightsError, match=r"missing tensors \(1\): model\.layers\.0\.mlp\.experts\.2\.up_proj"):
        load_model(d)


def test_dense_layers_between_sparse_ones_are_refused():
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf(dict(HF["qwen3_moe"], mlp_only_layers=[1]))
