"""surojax.models.vision against transformers 5.17's Qwen3VLVisionModel: tests/fixtures/vision/qwen3_vl_tower (made
by scripts/make_vision_fixtures.py: a tiny random tower, an image grid and a 2-frame clip, outputs in float64)."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from surojax.models.vision.config import VisionConfig, VisionConfigError
from surojax.models.vision.grid import vision_grid
from surojax.models.vision.hf_weights import VisionWeightsError, load_vision_tower

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vision" / "qwen3_vl_tower"


@pytest.fixture(scope="module")
def fixture():
    cfg = VisionConfig.from_hf(json.loads((FIXTURE / "config.json").read_text()), "qwen3_vl")
    with np.load(FIXTURE / "expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    return cfg, load_file(FIXTURE / "model.safetensors"), expected


def test_tower_equals_transformers(fixture):
    cfg, tensors, expected = fixture
    tower = load_vision_tower(cfg, tensors)
    grid = vision_grid(expected["grid_thw"], cfg.spatial_merge_size, cfg.position_grid_side)
    out = tower(jnp.asarray(expected["pixel_values"]), grid)
    np.testing.assert_allclose(np.asarray(out.last_hidden), expected["last_hidden"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.merged), expected["merged"], rtol=0, atol=1e-4)
    assert len(out.deepstack) == len(cfg.deepstack_visual_indexes) == 2
    for i, feature in enumerate(out.deepstack):
        np.testing.assert_allclose(np.asarray(feature), expected[f"deepstack{i}"], rtol=0, atol=1e-4)


def test_config_and_weights_refusals(fixture):
    cfg, tensors, _ = fixture
    raw = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(VisionConfigError, match="window_size"):
        VisionConfig.from_hf({**raw, "window_size": 112}, "qwen3_vl")
    with pytest.raises(VisionConfigError, match="no deepstack"):
        VisionConfig.from_hf(raw, "qwen3_5")
    assert VisionConfig.from_hf({k: v for k, v in raw.items() if k != "deepstack_visual_indexes"},
                                "qwen3_5").deepstack_visual_indexes == ()
    with pytest.raises(VisionWeightsError, match=r"missing \['model.visual.blocks.1.attn.qkv.weight'\]"):
        load_vision_tower(cfg, {k: v for k, v in tensors.items() if k != "model.visual.blocks.1.attn.qkv.weight"})
    bad = dict(tensors, **{"model.visual.merger.linear_fc2.bias": np.zeros(7, np.float32)})
    with pytest.raises(VisionWeightsError, match="merger.linear_fc2.bias has shape"):
        load_vision_tower(cfg, bad)


def test_qwen3_5_tower_equals_transformers():
    """Qwen3.5's tower (no deepstack) from the full qwen3_5 fixture checkpoint: config.json's vision_config under
    model_type qwen3_5, tensors model.visual.* among the language model's."""
    folder = FIXTURE.parents[1] / "models" / "qwen3_5"
    config = json.loads((folder / "config.json").read_text())
    cfg = VisionConfig.from_hf(config["vision_config"], config["model_type"])
    tower = load_vision_tower(cfg, load_file(folder / "model.safetensors"))
    with np.load(FIXTURE.parent / "qwen3_5_tower_expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    out = tower(jnp.asarray(expected["pixel_values"]),
                vision_grid(expected["grid_thw"], cfg.spatial_merge_size, cfg.position_grid_side))
    assert out.deepstack == ()
    np.testing.assert_allclose(np.asarray(out.merged), expected["merged"], rtol=0, atol=1e-4)
