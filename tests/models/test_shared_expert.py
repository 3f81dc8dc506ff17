"""The MoE layer's shared expert (qwen2_moe's `mlp.shared_expert` + `mlp.shared_expert_gate`): config keys read and
refused, the layer's formula and untouched router stats, and checkpoints saved and loaded in both weight layouts.

The logits parity against transformers is tests/models/test_hf_parity.py's `qwen2_moe` case (fixture made by
scripts/make_fixtures.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig, ModelConfigError, MoEConfig
from surojax.models.layers.moe import MoE
from surojax.models.registry import weight_rows
from surojax.weights.hf_checkpoint import hf_tensors, load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen2_moe"
HF = json.loads((FIXTURE / "config.json").read_text())


def test_config_keys_are_read_and_written_back():
    cfg = ModelConfig.from_hf(HF)
    assert cfg.moe == MoEConfig(8, 2, 32, norm_topk_prob=False, router_aux_loss_coef=0.001,
                                shared_expert_intermediate_size=48)
    assert cfg.attention_bias and not cfg.qk_norm and cfg.sliding_window is None
    out = cfg.to_hf()
    assert ModelConfig.from_hf(json.loads(json.dumps(out))) == cfg
    for k, v in HF.items():  # every key transformers wrote comes back with its value
        if k not in ("dtype", "rope_parameters", "sliding_window"):
            assert out[k] == v, k
    # transformers writes 0 for "no window" (use_sliding_window false) and reads null back to 0 as well
    assert HF["sliding_window"] == 0 and out["sliding_window"] is None and out["use_sliding_window"] is False
    f = SafetensorsFile(FIXTURE / "model.safetensors")
    assert cfg.num_params() == sum(int(np.prod(f.shape(n))) for n in f.names())
    # active: attention etc. + the router, k of E experts and the shared expert with its gate
    D = 64
    assert cfg.num_params() - cfg.num_active_params() == 2 * (8 - 2) * 3 * D * 32


def test_qkv_bias_false_is_read():
    cfg = ModelConfig.from_hf(dict(HF, qkv_bias=False))
    assert not cfg.attention_bias
    assert not any(r.hf.endswith("_proj.bias") for r in weight_rows(cfg))
    assert cfg.to_hf()["qkv_bias"] is False


@pytest.mark.parametrize("key,value", [("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("num_experts", 0)])
def test_dense_layers_are_refused_by_their_key(key, value):
    with pytest.raises(ModelConfigError, match=re.escape(f"qwen2_moe: {key} {value}")):
        ModelConfig.from_hf(dict(HF, **{key: value}))


def test_layer_adds_the_gated_shared_expert_and_leaves_the_router_alone():
    """MoE with a shared expert = the same MoE without it + sigmoid(x @ g) * SwiGLU(x) (computed here in numpy);
    the router stats are the same."""
    moe = MoEConfig(4, 2, 8, norm_topk_prob=True, shared_expert_intermediate_size=12)
    D = 16
    layer = MoE(D, moe, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    plain = MoE(D, MoEConfig(4, 2, 8, norm_topk_prob=True), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    plain.router, plain.experts = layer.router, layer.experts
    for lin in (layer.shared_expert_gate, layer.shared_expert.gate_proj, layer.shared_expert.up_proj,
                layer.shared_expert.down_proj):  # init std 0.02 would make the shared expert's part ~1e-4
        lin.kernel.set_value(lin.kernel.get_value() * 25)
    x = jax.random.normal(jax.random.key(1), (2, 5, D))
    seg = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 2, 2, 2]])
    y, stats = layer(x, seg)
    y0, stats0 = plain(x, seg)
    sh = layer.shared_expert
    xn = np.asarray(x, np.float64)
    gate = 1 / (1 + np.exp(-(xn @ np.asarray(layer.shared_expert_gate.kernel[...]))))  # [B, T, 1]
    g, u = xn @ np.asarray(sh.gate_proj.kernel[...]), xn @ np.asarray(sh.up_proj.kernel[...])
    shared = (g / (1 + np.exp(-g)) * u) @ np.asarray(sh.down_proj.kernel[...])
    assert np.abs(gate * shared).max() > 0.1 and gate.std() > 0.05
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0) + gate * shared, rtol=0, atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, stats, stats0)


def test_save_writes_the_published_names_and_loads_back(tmp_path):
    model = load_model(FIXTURE)
    save_model(model, tmp_path / "m")
    ours, theirs = SafetensorsFile(tmp_path / "m" / "model.safetensors"), SafetensorsFile(FIXTURE / "model.safetensors")
    assert sorted(ours.names()) == sorted(theirs.names())
    assert all(np.array_equal(ours.get(n), theirs.get(n)) for n in theirs.names())
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2MoeForCausalLM"] and cfg["shared_expert_intermediate_size"] == 48
    assert load_model(tmp_path / "m").cfg == model.cfg


def test_transformers5_fused_expert_names_load(tmp_path):
    """The in-memory names (experts fused [E, 2F, D] / [E, D, F]; the shared expert's names are the same)."""
    f = SafetensorsFile(FIXTURE / "model.safetensors")
    t = {n: np.asarray(f.get(n)) for n in f.names()}
    fused = {n: v for n, v in t.items() if ".experts." not in n}
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = np.stack(
            [np.concatenate([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
        fused[f"{p}.down_proj"] = np.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF))
    write_safetensors(d / "model.safetensors", fused)
    got = {k: np.asarray(v) for k, v in hf_tensors(load_model(d)).items()}
    assert sorted(got) == sorted(t)
    for name, value in got.items():
        np.testing.assert_array_equal(value, t[name], err_msg=name)
