"""ModelConfig.from_hf / to_hf: family flags, rope settings in both the transformers-5 (`rope_parameters`) and the
legacy (`rope_scaling` + `rope_theta`) spelling, bias inference and the errors for what surojax does not model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from surojax.models.config import ModelConfig, ModelConfigError, RopeScaling
from surojax.models.registry import FAMILIES, UnsupportedModelError

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES_ON_DISK = ["llama", "llama_tied", "qwen2", "qwen3", "mistral"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def hf_config(name: str = "llama", **changes) -> dict:
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def test_fixture_configs():
    c = {n: ModelConfig.from_hf(hf_config(n)) for n in FAMILIES_ON_DISK}
    assert (c["llama"].vocab_size, c["llama"].hidden_size, c["llama"].intermediate_size) == (512, 64, 128)
    assert (c["llama"].num_layers, c["llama"].num_heads, c["llama"].num_kv_heads, c["llama"].head_dim) == (2, 4, 2, 16)
    assert c["llama"].rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert c["llama_tied"].tie_word_embeddings and not c["llama"].tie_word_embeddings
    assert c["qwen2"].attention_bias and not any(c[n].attention_bias for n in ("llama", "qwen3", "mistral"))
    assert c["qwen3"].qk_norm and not any(c[n].qk_norm for n in ("llama", "qwen2", "mistral"))
    assert c["mistral"].sliding_window == 6 and c["qwen2"].sliding_window is None
    assert c["qwen3"].eos_token_id == 509 and c["qwen3"].bos_token_id == 507 and c["qwen3"].pad_token_id == 507


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf(hf_config(model_type="gpt_neox"))
    msg = str(e.value)
    assert "model_type 'gpt_neox' is not supported" in msg
    assert f"supported model types: {', '.join(sorted(FAMILIES))}" in msg and "qwen2" in msg
    assert e.value.is_user_error
    with pytest.raises(UnsupportedModelError, match="model_type None is not supported"):
        ModelConfig.from_hf(hf_config(model_type=None))


def test_missing_required_keys_are_named():
    with pytest.raises(ModelConfigError, match=r"lacks hidden_size, num_attention_heads \(model_type 'qwen3'\)"):
        ModelConfig.from_hf(hf_config("qwen3", hidden_size=None, num_attention_heads=None))


# ---- rope -----------------------------------------------------------------------------------------------------

def test_rope_parameters_and_legacy_rope_scaling_agree():
    v5 = ModelConfig.from_hf(hf_config(rope_parameters=LLAMA3_ROPE | {"rope_theta": 500000.0}))
    legacy = ModelConfig.from_hf(hf_config(rope_parameters=None, rope_theta=500000.0,
                                           rope_scaling={k if k != "rope_type" else "type": v
                                                         for k, v in LLAMA3_ROPE.items()}))
    assert v5 == legacy
    assert v5.rope_theta == 500000.0 and v5.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)


def test_rope_theta_sources():
    assert ModelConfig.from_hf(hf_config("qwen3")).rope_theta == 10000.0  # rope_parameters only (transformers 5)
    assert ModelConfig.from_hf(hf_config("qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
                               ).rope_theta == 1e6
    legacy = ModelConfig.from_hf(hf_config("qwen3", rope_parameters=None, rope_theta=1e6, rope_scaling=None))
    assert legacy.rope_theta == 1e6 and legacy.rope_scaling == RopeScaling()
    bare = ModelConfig.from_hf(hf_config("qwen3", rope_parameters=None))
    assert bare.rope_theta == 10000.0 and bare.rope_scaling.rope_type == "default"


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    """Both keys, theta only inside rope_parameters: transformers 5.17 reads rope_scaling and the default theta
    (checked with AutoConfig); surojax reads the same, so the two never run different ropes."""
    cfg = ModelConfig.from_hf(hf_config(rope_scaling=LLAMA3_ROPE | {"factor": 4.0},
                                        rope_parameters=LLAMA3_ROPE | {"rope_theta": 500000.0}))
    assert cfg.rope_scaling.factor == 4.0 and cfg.rope_theta == 10000.0


def test_linear_rope_and_unsupported_rope_types():
    cfg = ModelConfig.from_hf(hf_config(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0
    for rope_type in ("dynamic", "longrope"):
        with pytest.raises(ModelConfigError, match=f"rope_scaling type '{rope_type}' is not supported"):
            ModelConfig.from_hf(hf_config(rope_parameters={"rope_type": rope_type, "factor": 2.0}))


# ---- biases, flags ----------------------------------------------------------------------------------------------

def test_qwen2_bias_is_inferred_without_the_key():
    hf = hf_config("qwen2")
    assert "attention_bias" not in hf  # transformers writes none: Qwen2 always has q/k/v biases
    assert ModelConfig.from_hf(hf).attention_bias
    assert ModelConfig.from_hf(hf_config("qwen2", attention_bias=True)).attention_bias
    assert not ModelConfig.from_hf(hf_config("llama", attention_bias=None)).attention_bias
    assert not ModelConfig.from_hf(hf_config("mistral")).attention_bias


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_attention_bias_true_is_refused_where_it_would_add_an_o_proj_bias(family):
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf(hf_config(family, attention_bias=True))
    assert f"attention_bias: true is not supported for {family}" in str(e.value) and "o_proj" in str(e.value)
    assert not ModelConfig.from_hf(hf_config(family, attention_bias=False)).attention_bias


def test_mlp_bias_is_refused():
    with pytest.raises(ModelConfigError, match="mlp_bias: true is not supported"):
        ModelConfig.from_hf(hf_config(mlp_bias=True))
    assert ModelConfig.from_hf(hf_config(mlp_bias=False)).num_params() == ModelConfig.from_hf(hf_config()).num_params()


def test_sliding_window_only_where_the_family_honours_it():
    assert ModelConfig.from_hf(hf_config("mistral", sliding_window=4096)).sliding_window == 4096
    assert ModelConfig.from_hf(hf_config("mistral", sliding_window=None)).sliding_window is None
    assert ModelConfig.from_hf(hf_config("mistral", use_sliding_window=False)).sliding_window is None
    qwen2 = hf_config("qwen2", sliding_window=4096, use_sliding_window=False)
    assert ModelConfig.from_hf(qwen2).sliding_window is None


def test_defaults_and_shape_checks():
    cfg = ModelConfig.from_hf(hf_config(head_dim=None, num_key_value_heads=None))
    assert cfg.head_dim == 64 // 4 and cfg.num_kv_heads == cfg.num_heads == 4
    assert ModelConfig.from_hf(hf_config(eos_token_id=[509, 507])).eos_token_id == (509, 507)
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(4\) must be a multiple of "
                                               r"num_key_value_heads \(3\)"):
        ModelConfig.from_hf(hf_config(num_key_value_heads=3))
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_hf(hf_config(hidden_act="gelu"))


def test_num_params_matches_the_fixture_weights():
    from surojax.weights.safetensors_file import SafetensorsFile

    for name in FAMILIES_ON_DISK:
        f = SafetensorsFile(FIXTURES / name / "model.safetensors")
        total = sum(int(np.prod(f.shape(n))) for n in f.names())
        assert ModelConfig.from_hf(hf_config(name)).num_params() == total, name


# ---- to_hf ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES_ON_DISK)
def test_to_hf_round_trip(name):
    hf = hf_config(name)
    cfg = ModelConfig.from_hf(hf)
    out = cfg.to_hf()
    assert ModelConfig.from_hf(out) == cfg
    assert ModelConfig.from_hf(json.loads(json.dumps(out))) == cfg  # JSON-safe
    # every key transformers wrote comes back with its value (dtype is the saver's business; rope below)
    for k, v in hf.items():
        if k not in ("dtype", "rope_parameters"):
            assert out[k] == v, k
    assert out["rope_parameters"] == hf["rope_parameters"]
    assert out["rope_theta"] == hf["rope_parameters"]["rope_theta"]  # for transformers < 5
    assert "dtype" not in out and "torch_dtype" not in out


def test_to_hf_writes_legacy_rope_scaling_only_when_scaled():
    llama = ModelConfig.from_hf(hf_config("llama")).to_hf()
    assert llama["rope_scaling"] == LLAMA3_ROPE | {"type": "llama3"}
    assert llama["rope_parameters"] == LLAMA3_ROPE | {"rope_theta": 10000.0}
    assert "rope_scaling" not in ModelConfig.from_hf(hf_config("qwen3")).to_hf()


def test_to_hf_from_a_config_built_in_code():
    cfg = ModelConfig(model_type="qwen2", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, attention_bias=True,
                      rope_scaling=RopeScaling("linear", factor=4.0), eos_token_id=(1, 2))
    out = cfg.to_hf()
    assert out["architectures"] == ["Qwen2ForCausalLM"] and out["model_type"] == "qwen2"
    assert "attention_bias" not in out and "sliding_window" not in out  # qwen2 writes neither
    assert out["eos_token_id"] == (1, 2) and "bos_token_id" not in out
    assert out["rope_parameters"]["rope_type"] == out["rope_scaling"]["type"] == "linear"
    assert ModelConfig.from_hf(out) == cfg
