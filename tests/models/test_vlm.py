"""Vision-language decoders against transformers 5.17: Qwen3-VL, Qwen3-VL-MoE (deepstack), Qwen3.5, Qwen3.5-MoE with
images (scripts/make_vlm_fixtures.py; tests/fixtures/README.md, "vlm").

One jitted forward per checkpoint computes a [4, T] batch with padded patches (patch bucket 128 for 80 real ones):
row 0 one image (case a), row 1 two images of different sizes (b), row 2 text only (c), row 3 two packed segments
each with an image (a, then d), every real token's fp32 logits within 1e-4 of transformers' (the packed row against
transformers on each segment alone). Also: the 1-D rope path on text, the frozen tower (no gradient unless
`train_vision`), save-back, and the named errors before any device work."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import vision_filter
from surojax.models.vision.inputs import ImageInputError, VisionTokens, prepare_images
from surojax.weights.hf_checkpoint import load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
EXPECTED = Path(__file__).parent.parent / "fixtures" / "vlm"
FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
TOL = 1e-4
_MODELS: dict = {}


def _model(name: str):
    """The checkpoint (the Qwen3.5 ones with in-vocab image token ids, as the fixture script ran them)."""
    if name not in _MODELS:
        hf = json.loads((MODELS / name / "config.json").read_text()) | TOKENS
        _MODELS[name] = load_model(MODELS / name, cfg=ModelConfig.from_hf(hf))
    return _MODELS[name]


def _batch(e, T: int):
    """Rows a, b, c, a|d right-padded to T -> ids, positions, segment ids [4, T], per-row pixels and grids."""
    rows = [[e["a_ids"]], [e["b_ids"]], [e["c_ids"]], [e["a_ids"], e["d_ids"]]]
    ids, pos, seg = (np.zeros((4, T), np.int32) for _ in range(3))
    for b, segments in enumerate(rows):
        at = 0
        for k, s in enumerate(segments, 1):
            ids[b, at:at + len(s)], pos[b, at:at + len(s)], seg[b, at:at + len(s)] = s, np.arange(len(s)), k
            at += len(s)
    pixels = [e["a_pixels"], e["b_pixels"], None, np.concatenate([e["a_pixels"], e["d_pixels"]])]
    grids = [e["a_grid"], e["b_grid"], None, np.concatenate([e["a_grid"], e["d_grid"]])]
    return ids, pos, seg, pixels, grids


def _forward(model, ids, pos, seg, images, rope):
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda state, *a: nnx.merge(graphdef, state)(*a[:3], images=a[3], rope_positions=a[4]))
    return np.asarray(f(state, ids, pos, seg, images, rope))


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_with_images_match_transformers(name):
    e = dict(np.load(EXPECTED / f"{name}.npz"))
    model = _model(name)
    T = len(e["a_ids"]) + len(e["d_ids"])
    ids, pos, seg, pixels, grids = _batch(e, T)
    batch = prepare_images(VisionTokens.from_config(model.cfg), ids, pixels, grids, segment_ids=seg,
                           patch_bucket=128)
    assert batch.images.pixel_values.shape[0] == 128 and batch.images.token_index.shape == (32,)
    # each row's last segment's rope delta: a's 12 tokens reach position 9 (its 2 x 2 merged image advances by 2), b's
    # 18 reach 14 (1 x 3 and 3 x 2 images advance by 3 each), d's 8 reach 7
    assert batch.rope_deltas.tolist() == [-2, -3, 0, 0]
    logits = _forward(model, ids, pos, seg, batch.images, batch.rope_positions)
    na, nd = len(e["a_ids"]), len(e["d_ids"])
    checks = {"a": (logits[0, :na], e["a_logits"]), "b": (logits[1, :len(e["b_ids"])], e["b_logits"]),
              "c": (logits[2, :len(e["c_ids"])], e["c_logits"]),
              "packed a": (logits[3, :na], e["a_logits"]), "packed d": (logits[3, na:na + nd], e["d_logits"])}
    for case, (ours, theirs) in checks.items():
        np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0, err_msg=f"{name} case {case}")


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_vl_moe"])
def test_config_round_trip(name):
    """to_hf writes what from_hf reads back: text_config with the M-RoPE sections, the MoE keys, vision_config."""
    cfg = ModelConfig.from_hf(json.loads((MODELS / name / "config.json").read_text()))
    hf = cfg.to_hf()
    assert ModelConfig.from_hf(hf) == cfg and cfg.mrope_section == (4, 2, 2)
    assert hf["text_config"]["rope_parameters"]["mrope_section"] == [4, 2, 2] and "vision_config" in hf


def test_text_only_one_d_rope_matches_transformers():
    """No images, no rope_positions: the plain 1-D rope equals M-RoPE on text (transformers' text-only logits)."""
    e = np.load(EXPECTED / "qwen3_vl.npz")
    logits = _model("qwen3_vl")(jnp.asarray(e["c_ids"][None]))
    np.testing.assert_allclose(np.asarray(logits[0]), e["c_logits"], atol=TOL, rtol=0)


def test_tower_frozen_unless_asked():
    e = np.load(EXPECTED / "qwen3_vl.npz")
    model = _model("qwen3_vl")
    ids = e["a_ids"][None].astype(np.int32)
    batch = prepare_images(VisionTokens.from_config(model.cfg), ids, [e["a_pixels"]], [e["a_grid"]])
    graphdef, tower, rest = nnx.split(model, vision_filter, ...)

    def grad_norm(tower, train_vision: bool):
        def loss(tower):
            m = nnx.merge(graphdef, tower, rest)
            m.train_vision = train_vision
            return m(jnp.asarray(ids), images=batch.images, rope_positions=batch.rope_positions).sum()
        return sum(jnp.abs(x).sum() for x in jax.tree.leaves(jax.grad(loss)(tower)))

    # both gradients in one jitted program (eager, each op of the forward and backward compiled on its own: ~5x slower)
    frozen, trained = jax.jit(lambda tower: (grad_norm(tower, False), grad_norm(tower, True)))(tower)
    assert float(frozen) == 0.0, "the tower got a gradient without train_vision"
    assert float(trained) > 0.0, "the tower got no gradient with train_vision"


def test_save_back_holds_the_tower(tmp_path):
    """save_model writes the tower beside the text model (the fixture's tensors exactly) and it loads back."""
    f = SafetensorsFile(MODELS / "qwen3_vl" / "model.safetensors")
    saved = SafetensorsFile(save_model(_model("qwen3_vl"), tmp_path / "out") / "model.safetensors")
    assert set(saved.names()) == set(f.names())
    for n in f.names():
        np.testing.assert_array_equal(saved.get(n), f.get(n), err_msg=n)
    assert load_model(tmp_path / "out").visual is not None


def test_qwen3_vl_moe_expert_layouts_load_alike(tmp_path):
    """The experts as published ([E, D, 2F] / [E, F, D]) and as transformers 5.17 saves them ([E, 2F, D] /
    [E, D, F], the fixture's) load to the same model."""
    d = MODELS / "qwen3_vl_moe"
    f = SafetensorsFile(d / "model.safetensors")
    published = {n: np.swapaxes(f.get(n), 1, 2) if ".mlp.experts." in n else f.get(n) for n in f.names()}
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    write_safetensors(tmp_path / "model.safetensors", published)
    a, b = nnx.state(_model("qwen3_vl_moe"), nnx.Param), nnx.state(load_model(tmp_path), nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_transformers_layout_equals_per_row_lists():
    """pixel_values / image_grid_thw as transformers passes them (the batch's images in row order) give the same
    inputs as one entry per row."""
    e = dict(np.load(EXPECTED / "qwen3_vl.npz"))
    ids, pos, seg, pixels, grids = _batch(e, len(e["a_ids"]) + len(e["d_ids"]))
    tokens = VisionTokens.from_config(_model("qwen3_vl").cfg)
    rows = prepare_images(tokens, ids, pixels, grids, segment_ids=seg)
    flat = prepare_images(_model("qwen3_vl").cfg, ids, np.concatenate([p for p in pixels if p is not None]),
                          np.concatenate([g for g in grids if g is not None] + [np.zeros((2, 3), int)]),
                          segment_ids=seg)
    jax.tree.map(np.testing.assert_array_equal, (rows.images, rows.rope_positions),
                 (flat.images, flat.rope_positions))
    with pytest.raises(ImageInputError, match="image_grid_thw has 3 images but input_ids hold 5 runs"):
        prepare_images(tokens, ids, np.concatenate([p for p in pixels if p is not None]),
                       np.concatenate([g for g in grids if g is not None][:-1]), segment_ids=seg)


def test_named_errors():
    e = np.load(EXPECTED / "qwen3_vl.npz")
    tokens = VisionTokens.from_config(_model("qwen3_vl").cfg)
    ids = e["a_ids"][None]
    with pytest.raises(ImageInputError, match="row 0: 4 image tokens .* no pixel_values"):
        prepare_images(tokens, ids, None, None)
    with pytest.raises(ImageInputError, match="row 0, segment 1 .*4 image tokens but image 0 has grid"):
        prepare_images(tokens, ids, [e["b_pixels"][:12]], [e["b_grid"][:1]])
    with pytest.raises(ImageInputError, match="pixel_values has 15 rows, image_grid_thw's grids need 16"):
        prepare_images(tokens, ids, [e["a_pixels"][:15]], [e["a_grid"]])
    with pytest.raises(ImageInputError, match="image_grid_thw has 2 images but the row's segments hold 1"):
        prepare_images(tokens, ids, [np.concatenate([e["a_pixels"], e["d_pixels"]])],
                       [np.concatenate([e["a_grid"], e["d_grid"]])])
    batch = prepare_images(tokens, ids, [e["a_pixels"]], [e["a_grid"]])
    text_only = load_model(MODELS / "qwen3_5_text")
    with pytest.raises(ValueError, match="no vision tower"):
        text_only(jnp.asarray(ids), images=batch.images, rope_positions=batch.rope_positions)
    with pytest.raises(ValueError, match="images need rope_positions"):
        _model("qwen3_vl")(jnp.asarray(ids), images=batch.images)
