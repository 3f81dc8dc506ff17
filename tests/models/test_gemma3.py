"""Gemma 3 text (`gemma3_text`, and the text backbone of the multimodal `gemma3`) beyond the logits parity of
tests/models/test_hf_parity.py (fp32 logits alone / padded / packed and 32 greedy tokens = transformers, over the
fixtures of scripts/make_gemma3_fixtures.py: 5 layers [sliding x 2, full] + [sliding x 2], window 4, two rope
bases, query_pre_attn_scalar 24): the config's reading (transformers 5's per-layer-type rope_parameters and the
legacy keys alike; what is refused, by name), the layer pattern, the multimodal checkpoint (vision tower skipped
with a log line; the published `language_model.model.*` names and transformers 5's in-memory
`model.language_model.*` load alike), save -> load, the LoRA targets and their PEFT names."""
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig, ModelConfigError
from surojax.models.decoder import layer_pattern
from surojax.models.layer_runner import LayerPattern, LayerType, uniform_stack
from surojax.models.targets import model_targets
from surojax.peft.lora import apply_lora
from surojax.peft.peft_io import WEIGHTS_FILE, save_peft_adapter
from surojax.weights.hf_checkpoint import load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES = ["gemma3_text", "gemma3"]


def _hf(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _text(hf: dict) -> dict:
    return hf.get("text_config", hf)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_reads_the_gemma_keys(name):
    cfg = ModelConfig.from_hf(_hf(name))
    assert cfg.model_type == name and cfg.tie_word_embeddings and cfg.qk_norm and cfg.norm_zero_centered
    assert cfg.sandwich_norms and cfg.scale_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.query_pre_attn_scalar == 24 and cfg.sliding_window == 4
    assert cfg.layer_windows == (4, 4, None, 4, 4)
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (1e6, "linear", 8.0)
    assert (cfg.local_rope_theta, cfg.local_rope_scaling.rope_type) == (1e4, "default")
    assert [cfg.layer_rope(i) for i in range(5)] == [1, 1, 0, 1, 1]
    assert cfg.num_params() == int(np.load(FIXTURES / name / "expected.npz")["num_params"])


def test_layer_pattern_gives_each_type_its_window_and_rope():
    """[sliding x 2, full] once, then the remainder [sliding x 2]; one stack `layers`."""
    pattern = layer_pattern(ModelConfig.from_hf(_hf("gemma3_text")))
    sliding, full = LayerType("layers", (("window", 4), ("rope", 1))), LayerType("layers", (("window", 0), ("rope", 0)))
    assert pattern == LayerPattern((sliding, sliding, full), 5)
    assert (pattern.groups, pattern.remainder) == (1, 2)
    # every layer sliding: one type, still with its rope option, which a runner of its own cannot pass: refused
    hf = _hf("gemma3_text") | {"layer_types": ["sliding_attention"] * 5}
    uniform = layer_pattern(ModelConfig.from_hf(hf))
    assert uniform == LayerPattern((LayerType("layers", (("rope", 1),)),), 5)
    with pytest.raises(ValueError, match="without per-type options"):
        uniform_stack(uniform, {"layers": None}, "PrefetchedLayers")


def test_legacy_keys_read_as_transformers_5_converts_them():
    """rope_theta + rope_scaling (full attention), rope_local_base_freq (sliding), sliding_window_pattern without
    layer_types: transformers 5.17's Gemma3TextConfig turns these legacy keys (sliding_window_pattern 3 over 5
    layers) into exactly the fixture's layer_types and per-type rope_parameters (checked in the reference env
    when this test was written); we read the same architecture."""
    hf = {k: v for k, v in _hf("gemma3_text").items() if k not in ("layer_types", "rope_parameters",
                                                                    "_sliding_window_pattern")}
    legacy = hf | {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                   "rope_local_base_freq": 1e4, "sliding_window_pattern": 3}
    assert ModelConfig.from_hf(legacy) == ModelConfig.from_hf(_hf("gemma3_text"))


@pytest.mark.parametrize("key, value, match", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping 30.0 is not supported"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping 50.0 is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}, "per layer type"),
    ("sliding_window", None, "sliding_window None"),
    ("hidden_act", "silu", "hidden_act 'silu' differs from hidden_activation"),
    ("attention_bias", True, "attention_bias"),
])
@pytest.mark.parametrize("name", FAMILIES)
def test_unsupported_keys_are_refused_by_name(name, key, value, match):
    hf = _hf(name)
    bad = hf | {"text_config": _text(hf) | {key: value}} if "text_config" in hf else hf | {key: value}
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf(bad)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_round_trip(name):
    """config.json -> ModelConfig -> config.json: the same architecture, in transformers 5's spelling."""
    hf = _hf(name)
    cfg = ModelConfig.from_hf(hf)
    out = cfg.to_hf()
    assert ModelConfig.from_hf(out) == cfg
    text = _text(out)
    for key in ("layer_types", "rope_parameters", "query_pre_attn_scalar", "hidden_activation", "sliding_window",
                "final_logit_softcapping", "attn_logit_softcapping", "head_dim", "intermediate_size"):
        assert text[key] == _text(hf)[key], key
    assert "rope_theta" not in text and "hidden_act" not in text
    if name == "gemma3":
        assert out["vision_config"] == hf["vision_config"] and out["architectures"] == hf["architectures"]
        assert text["model_type"] == "gemma3_text"


def test_vision_tower_is_skipped_with_a_log_line(caplog):
    d = FIXTURES / "gemma3"
    names = SafetensorsFile(d / "model.safetensors").names()
    vision = sum(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in names)
    assert vision > 0 and any(n.startswith("language_model.model.layers.") for n in names)  # the published layout
    with caplog.at_level(logging.INFO, logger="surojax.weights.hf_checkpoint"):
        load_model(d, dtype=jnp.float32, attention="xla")
    assert any(f"skipping {vision} tensors" in r.getMessage() and "vision_tower." in r.getMessage()
               for r in caplog.records)


def _params_equal(a, b):
    a, b = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_folder_loads_back(name, tmp_path):
    """save_model writes the text tensors under transformers 5's names (the CausalLM's exactly the fixture's; the
    multimodal one's `model.language_model.*`, the in-memory names transformers 5 loads, where the fixture has the
    published `language_model.model.*`), the same shapes and bits, and its config; it loads back equal."""
    model = load_model(FIXTURES / name, dtype=jnp.float32, attention="xla")
    out = save_model(model, tmp_path / name)
    saved = SafetensorsFile(out / "model.safetensors")
    fixture = SafetensorsFile(FIXTURES / name / "model.safetensors")
    published = {n.replace("language_model.model.", "model.language_model."): n for n in fixture.names()
                 if not n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert set(saved.names()) == set(published)
    assert all(np.array_equal(saved.get(n), fixture.get(p)) for n, p in published.items())
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == _hf(name)["architectures"]
    back = load_model(out, dtype=jnp.float32, attention="xla")
    assert back.cfg == model.cfg
    _params_equal(model, back)


def test_multimodal_in_memory_names_load_like_the_published_ones(tmp_path):
    d = FIXTURES / "gemma3"
    f = SafetensorsFile(d / "model.safetensors")
    renamed = {n.replace("language_model.model.", "model.language_model.").replace("vision_tower.",
                                                                                     "model.vision_tower."):
               np.asarray(f.get(n)) for n in f.names()}
    out = tmp_path / "in_memory"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    write_safetensors(out / "model.safetensors", renamed)
    _params_equal(load_model(d, dtype=jnp.float32, attention="xla"), load_model(out, dtype=jnp.float32,
                                                                                 attention="xla"))


@pytest.mark.parametrize("name, prefix", [("gemma3_text", "base_model.model.model.layers"),
                                          ("gemma3", "base_model.model.model.language_model.layers")])
def test_lora_targets_export_under_peft_names(name, prefix, tmp_path):
    model = load_model(FIXTURES / name, dtype=jnp.float32, attention="xla")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert model_targets(model) == targets
    apply_lora(model, targets=list(targets), rank=2, alpha=4, rngs=nnx.Rngs(0))
    out = save_peft_adapter(model, tmp_path / "adapter", str(FIXTURES / name))
    names = set(SafetensorsFile(out / WEIGHTS_FILE).names())
    assert len(names) == 2 * 7 * 5
    assert f"{prefix}.2.self_attn.q_proj.lora_A.weight" in names
    assert f"{prefix}.4.mlp.down_proj.lora_B.weight" in names
