"""YaRN rope against transformers: inv_freq, the attention factor and cos / sin equal the tables transformers'
own rotary embeddings computed (tests/fixtures/rope/, made by scripts/make_rope_fixtures.py), and the yarn keys
survive to_hf -> from_hf."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from surojax.models.config import ModelConfig, RopeScaling
from surojax.models.layers.rope import attention_factor, inv_freq, rope_cos_sin

ROPE = Path(__file__).parent.parent / "fixtures" / "rope"
CONFIGS = json.loads((ROPE / "configs.json").read_text())


def rope_config(name: str) -> ModelConfig:
    """The fixture's rope settings in a ModelConfig (gpt_oss read through RopeScaling.from_hf: its registry
    entry is not what this test is about; the llama cases through ModelConfig.from_hf)."""
    hf = CONFIGS[name]
    if hf["model_type"] == "llama":
        return ModelConfig.from_hf(hf)
    return ModelConfig("llama", 64, 64, 64, 2, 4, 2, hf["head_dim"], rope_theta=hf["rope_parameters"]["rope_theta"],
                       rope_scaling=RopeScaling.from_hf(hf["rope_parameters"], hf),
                       max_position_embeddings=hf["max_position_embeddings"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_yarn_tables_equal_transformers(name):
    cfg, want = rope_config(name), np.load(ROPE / f"{name}.npz")
    assert cfg.rope_scaling.rope_type == "yarn"
    np.testing.assert_array_equal(inv_freq(cfg), want["inv_freq"])  # bit for bit: see yarn_inv_freq
    assert attention_factor(cfg) == pytest.approx(float(want["attention_scaling"]), rel=1e-12)
    cos, sin = rope_cos_sin(jnp.asarray(want["positions"])[None], inv_freq(cfg), jnp.float32, attention_factor(cfg))
    # same fp32 angles (one rounded product each); cos/sin of XLA and torch differ in the last bits only
    np.testing.assert_allclose(np.asarray(cos), want["cos"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(sin), want["sin"], atol=1e-6, rtol=0)


def test_the_cases_exercise_each_yarn_knob():
    """The fixture cases differ where the formula branches (else the test above could pass with a knob unread)."""
    gpt, msc, imp = (rope_config(n).rope_scaling for n in ("gpt_oss", "llama_mscale", "llama_implied"))
    assert not gpt.truncate and msc.truncate
    assert (msc.mscale, msc.mscale_all_dim) == (0.9, 0.5) and imp.attention_factor == 1.25
    assert imp.factor == 8.0  # null factor = max_position_embeddings / original_max_position_embeddings
    assert (msc.beta_fast, msc.beta_slow) == (16.0, 2.0)
    assert len({float(np.load(ROPE / f"{n}.npz")["attention_scaling"]) for n in CONFIGS}) == 3


def test_yarn_round_trips_through_to_hf():
    cfg = rope_config("llama_mscale")
    out = cfg.to_hf()
    assert out["rope_parameters"] == CONFIGS["llama_mscale"]["rope_parameters"] | {"truncate": True}
    assert out["rope_scaling"]["type"] == "yarn"
    assert ModelConfig.from_hf(out) == cfg
    llama3 = ModelConfig.from_hf(CONFIGS["llama_mscale"] | {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})
    assert "beta_fast" not in llama3.to_hf()["rope_parameters"]  # only the keys of the rope_type are written


def test_unmodelled_rope_keys_are_refused():
    hf = CONFIGS["llama_mscale"]
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf(hf | {"rope_parameters": hf["rope_parameters"] | {"partial_rotary_factor": 0.5}})
