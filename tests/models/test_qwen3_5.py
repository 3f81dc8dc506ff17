"""Qwen3.5 dense (Gated DeltaNet + gated attention hybrid) against transformers: tiny random checkpoints made by
transformers 5.17 (scripts/make_qwen3_5_fixtures.py; tests/fixtures/README.md) loaded by surojax give the same fp32
logits (max abs diff <= 1e-4) alone, padded (right and left) and packed; the text-only checkpoint (qwen3_5_text:
model.layers.*, 6 layers = one [linear x 3, full] group and a remainder of two) and the multimodal one (qwen3_5:
model.language_model.*, text_config, a vision tower that is skipped). A saved folder loads back equal (transformers
loading it: scripts/check_transformers_load.py, run once); LoRA on the DeltaNet projections trains and is exported
under PEFT's names.

One jitted program per family computes every logits check (the longest sequence alone, and one [5, T] batch: row 0
packs the three sequences, rows 1..3 hold each right-padded, row 4 the longest left-padded)."""
import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.generation.loop import generate
from surojax.models.config import ModelConfig
from surojax.models.decoder import layer_pattern
from surojax.models.layer_runner import LayerType
from surojax.models.registry import stack_layers, weight_rows
from surojax.peft.lora import TRAINABLE, apply_lora, lora_modules
from surojax.peft.peft_io import WEIGHTS_FILE, load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES = ["qwen3_5_text", "qwen3_5"]
TOL = 1e-4
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


TEXT = FAMILIES[0]  # padding, packing and generation run on the text checkpoint (the multimodal one shares its code)


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(graphdef, state, alone, batch):
    model = nnx.merge(graphdef, state)
    return model(alone), None if batch is None else model(*batch)


def _batch(seqs):
    """Row 0: the sequences packed (segment ids 1, 2, 3, positions restarting) then padding; rows 1..3: each
    right-padded; row 4: the longest left-padded (padding id 0 first, the sequence at the end)."""
    T = sum(map(len, seqs)) + 3
    tokens, seg, pos = (np.zeros((2 + len(seqs), T), np.int32) for _ in range(3))
    starts, at = [], 0
    for i, s in enumerate(seqs):
        n = len(s)
        tokens[0, at:at + n], seg[0, at:at + n], pos[0, at:at + n] = s, i + 1, np.arange(n)
        tokens[1 + i, :n], seg[1 + i, :n], pos[1 + i, :n] = s, 1, np.arange(n)
        starts.append(at)
        at += n
    longest = seqs[-1]
    tokens[-1, T - len(longest):], seg[-1, T - len(longest):] = longest, 1
    pos[-1, T - len(longest):] = np.arange(len(longest))
    return tokens, pos, seg, starts


@functools.cache
def _case(name: str):
    d = FIXTURES / name
    exp = np.load(d / "expected.npz")
    seqs = [exp[f"tokens{i}"].tolist() for i in range(3)]
    assert len(seqs[-1]) == max(map(len, seqs))
    model = load_model(d, dtype=jnp.float32, attention="xla")
    tokens, pos, seg, starts = _batch(seqs)
    graphdef, state = nnx.split(model)
    batch = (jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)) if name == TEXT else None
    alone, rows = _all_logits(graphdef, state, jnp.asarray([seqs[-1]]), batch)
    return name, model, seqs, [exp[f"logits{i}"] for i in range(3)], exp, \
        dict(alone=np.asarray(alone)[0], batch=None if rows is None else np.asarray(rows), starts=starts)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    return _case(request.param)


@pytest.fixture(scope="module")
def text_case():
    return _case(TEXT)


def test_config_is_the_hybrid(case):
    name, model, *_ = case
    cfg = model.cfg
    assert cfg.model_type == name and cfg.attn_output_gate and cfg.norm_zero_centered and cfg.qk_norm
    assert cfg.rotary_dim == 4 and cfg.partial_rotary_factor == 0.25
    la = cfg.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (2, 4, 8, 16, 4)
    assert cfg.tie_word_embeddings == (name == "qwen3_5")


def test_a_sequence_alone(case):
    _, _, _, logits, _, got = case
    np.testing.assert_allclose(got["alone"], logits[-1], atol=TOL, rtol=0)


def test_right_padded(text_case):
    _, _, seqs, logits, _, got = text_case
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(got["batch"][1 + i, :len(s)], logits[i], atol=TOL, rtol=0)


def test_left_padded(text_case):
    """Padding before the sequence: the conv and the delta rule's state start fresh at the sequence."""
    _, _, seqs, logits, _, got = text_case
    np.testing.assert_allclose(got["batch"][-1, -len(seqs[-1]):], logits[-1], atol=TOL, rtol=0)


def test_packed(text_case):
    """Two (three) documents in one row compute what each computes alone."""
    _, _, seqs, logits, _, got = text_case
    for i, s in enumerate(seqs):
        at = got["starts"][i]
        np.testing.assert_allclose(got["batch"][0, at:at + len(s)], logits[i], atol=TOL, rtol=0)


def test_parameter_count(case):
    _, model, _, _, exp, _ = case
    counted = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert model.cfg.num_params() == counted == int(exp["num_params"])


def test_layer_pattern_and_stacks():
    """[linear x 3, full] x G from layer_types: the stacks hold the HF layers of their kind in order."""
    cfg = ModelConfig.from_hf(json.loads((FIXTURES / "qwen3_5_text" / "config.json").read_text()))
    pattern = layer_pattern(cfg)
    assert pattern.types == (LayerType("linear_layers"),) * 3 + (LayerType("layers"),)
    assert (pattern.groups, pattern.remainder) == (1, 2)
    assert stack_layers(cfg, "layers") == (3,) and stack_layers(cfg, "linear_layers") == (0, 1, 2, 4, 5)
    with pytest.raises(ValueError, match="stacks are"):
        stack_layers(cfg, "other")


def test_config_round_trip():
    """config.json -> ModelConfig -> config.json keeps the architecture (text_config nesting, the vision config
    as read, layer types, partial rope, mrope sections)."""
    for name in FAMILIES:
        hf = json.loads((FIXTURES / name / "config.json").read_text())
        cfg = ModelConfig.from_hf(hf)
        out = cfg.to_hf()
        assert ModelConfig.from_hf(out) == cfg
        text = out.get("text_config", out)
        assert text["rope_parameters"]["mrope_section"] == [1, 1, 0]
        assert text["layer_types"] == (hf.get("text_config") or hf)["layer_types"]
        if name == "qwen3_5":
            assert out["vision_config"] == hf["vision_config"] and out["architectures"] == hf["architectures"]


def test_bad_configs_are_refused():
    hf = json.loads((FIXTURES / "qwen3_5_text" / "config.json").read_text())
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**hf, "layer_types": ["linear_attention", "sliding_attention"] * 3})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        ModelConfig.from_hf({**hf, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "text_config"} | {"model_type": "qwen3_5"})


def test_vision_tower_is_skipped_with_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="surojax.weights.hf_checkpoint"):
        load_model(FIXTURES / "qwen3_5", dtype=jnp.float32, attention="xla")
    assert any("model.visual." in r.getMessage() and "skipping 21 tensors" in r.getMessage() for r in caplog.records)


def test_saved_folder_loads_back(case, tmp_path):
    """save_model writes the published names (the fixture's text tensors exactly) and loads back equal."""
    name, model, *_ = case
    out = save_model(model, tmp_path / name)
    saved = set(SafetensorsFile(out / "model.safetensors").names())
    published = {n for n in SafetensorsFile(FIXTURES / name / "model.safetensors").names() if "visual" not in n}
    assert saved == published
    back = load_model(out, dtype=jnp.float32, attention="xla")
    assert back.cfg == model.cfg
    a, b = nnx.state(model, nnx.Param), nnx.state(back, nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_lora_on_the_deltanet_trains_and_exports_as_peft(tmp_path):
    """LoRA on the DeltaNet projections and the MLP (both stacks): a gradient step lowers the loss, the adapter saves
    under PEFT's names (HF layer indices) and loads back into a fresh model with the same logits."""
    d = FIXTURES / "qwen3_5_text"
    model = load_model(d, dtype=jnp.float32, attention="xla")
    apply_lora(model, targets=list(DELTANET) + ["gate_proj"], rank=4, alpha=8, rngs=nnx.Rngs(0))
    assert set(lora_modules(model)) == {"gate_proj", "linear_layers.gate_proj",
                                        *(f"linear_layers.{t}" for t in DELTANET)}
    tokens = jnp.asarray(np.load(d / "expected.npz")["tokens2"])[None]
    graphdef, trainable, rest = nnx.split(model, TRAINABLE, ...)

    @jax.jit
    def loss_fn(trainable):
        logits = nnx.merge(graphdef, trainable, rest)(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    loss0, grads = jax.jit(jax.value_and_grad(loss_fn))(trainable)
    b_grads = [g for path, g in nnx.to_flat_state(grads) if path[-1] == "lora_b"]  # A's are 0 while B = 0
    assert len(b_grads) == 7 and all(np.abs(np.asarray(g.get_value())).max() > 0 for g in b_grads)
    stepped = jax.tree.map(lambda p, g: p - 0.5 * g, trainable, grads)
    assert float(loss_fn(stepped)) < float(loss0)

    nnx.update(model, stepped)
    out = save_peft_adapter(model, tmp_path / "adapter", str(d))
    names = set(SafetensorsFile(out / WEIGHTS_FILE).names())
    assert "base_model.model.model.layers.4.linear_attn.in_proj_qkv.lora_A.weight" in names
    assert "base_model.model.model.layers.3.mlp.gate_proj.lora_B.weight" in names
    assert not any("layers.3.linear_attn" in n for n in names)
    assert len(names) == 2 * (5 * 5 + 6)  # A and B: five DeltaNet targets x 5 layers + gate_proj x 6 layers
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(["gate_proj", *DELTANET])

    adapter = load_peft_adapter(out, rows=tuple(weight_rows(model.cfg)), model_cfg=model.cfg)
    assert adapter.weights["linear_layers.in_proj_qkv"][0].shape == (5, 32, 4)
    fresh = load_model(d, dtype=jnp.float32, attention="xla")
    load_adapter_into(fresh, out, trainable=True)
    g_fresh, s_fresh = nnx.split(fresh)
    assert g_fresh == nnx.split(model)[0]  # the same structure: the loaded adapter sits where the trained one was
    np.testing.assert_allclose(float(loss_fn(nnx.state(fresh, TRAINABLE))), float(loss_fn(stepped)), atol=1e-6)


def test_greedy_generation_equals_transformers(text_case):
    """32 greedy tokens through the hybrid cache (prefill by the chunk rule, decode by the recurrent step, the
    attention layers' KV cache) = transformers' cached greedy generation."""
    _, model, seqs, _, exp, _ = text_case
    assert generate(model, [seqs[1]], 32) == [exp["greedy"].tolist()]
