"""Qwen3.5 MoE (Gated DeltaNet + gated attention hybrid, every layer's MLP the sparse MoE with a shared expert, in
both stacks) against transformers: tiny random checkpoints made by transformers 5.17 (scripts/make_qwen3_5_fixtures.py;
tests/fixtures/README.md) give the same fp32 logits (max abs diff <= 1e-4) alone, padded and packed, and the
same 32 greedy tokens: the text-only checkpoint (qwen3_5_moe_text: model.layers.*, 6 layers [linear x 3, full,
linear x 2]) and the multimodal one (qwen3_5_moe: model.language_model.*, text_config, the vision tower skipped).
The router statistics cover every layer of both stacks in HF layer order (= transformers' per-layer top-k counts;
the load-balancing loss = transformers' aux_loss); both weight layouts load; LoRA over attention, DeltaNet, both
expert projections and the shared expert trains and is exported under PEFT's names (peft loading it: checked once
by scripts/check_qwen3_5_moe_peft.py, tests/fixtures/README.md)."""
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
from surojax.losses.router import load_balancing_loss
from surojax.models.config import ModelConfig, ModelConfigError
from surojax.models.registry import stack_layers
from surojax.models.targets import model_targets, resolve_model_targets
from surojax.peft.lora import TRAINABLE, apply_lora, lora_modules
from surojax.peft.peft_io import WEIGHTS_FILE
from surojax.peft.stacked import load_adapter_into
from surojax.peft.trained_router import add_router_to_adapter, make_router_trainable
from surojax.peft.peft_io import save_peft_adapter
from surojax.train.router_monitor import RouterMonitor
from surojax.weights.hf_checkpoint import load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

from tests.models.test_qwen3_5 import _batch  # rows: packed, each right-padded, the longest left-padded

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES = ["qwen3_5_moe_text", "qwen3_5_moe"]
TOL = 1e-4
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


TEXT = FAMILIES[0]  # padding, packing and generation run on the text checkpoint (the multimodal one shares its code)


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(graphdef, state, alone, batch):
    model = nnx.merge(graphdef, state)
    stats = model.hidden_states(alone, jnp.arange(alone.shape[1])[None], jnp.ones_like(alone)).router_stats
    return model(alone), None if batch is None else model(*batch), stats


@functools.cache
def _case(name: str):
    d = FIXTURES / name
    exp = np.load(d / "expected.npz")
    seqs = [exp[f"tokens{i}"].tolist() for i in range(3)]
    model = load_model(d, dtype=jnp.float32, attention="xla")
    tokens, pos, seg, starts = _batch(seqs)
    graphdef, state = nnx.split(model)
    batch = (jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)) if name == TEXT else None
    alone, rows, stats = _all_logits(graphdef, state, jnp.asarray([seqs[-1]]), batch)
    return name, model, seqs, [exp[f"logits{i}"] for i in range(3)], exp, \
        dict(alone=np.asarray(alone)[0], batch=None if rows is None else np.asarray(rows), starts=starts,
             stats=stats)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    return _case(request.param)


@pytest.fixture(scope="module")
def text_case():
    return _case(TEXT)


def test_config_is_the_moe_hybrid(case):
    name, model, *_ = case
    cfg = model.cfg
    assert cfg.model_type == name and cfg.attn_output_gate and cfg.linear_attention is not None
    moe = cfg.moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size,
            moe.shared_expert_intermediate_size) == (4, 2, 16, 24)
    assert moe.norm_topk_prob and moe.router_aux_loss_coef == 0.02 and cfg.intermediate_size == 0
    assert cfg.tie_word_embeddings == (name == "qwen3_5_moe")


def test_a_sequence_alone(case):
    _, _, _, logits, _, got = case
    np.testing.assert_allclose(got["alone"], logits[-1], atol=TOL, rtol=0)


def test_right_padded(text_case):
    _, _, seqs, logits, _, got = text_case
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(got["batch"][1 + i, :len(s)], logits[i], atol=TOL, rtol=0)


def test_left_padded(text_case):
    _, _, seqs, logits, _, got = text_case
    np.testing.assert_allclose(got["batch"][-1, -len(seqs[-1]):], logits[-1], atol=TOL, rtol=0)


def test_packed(text_case):
    _, _, seqs, logits, _, got = text_case
    for i, s in enumerate(seqs):
        at = got["starts"][i]
        np.testing.assert_allclose(got["batch"][0, at:at + len(s)], logits[i], atol=TOL, rtol=0)


def test_parameter_count(case):
    _, model, _, _, exp, _ = case
    counted = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert model.cfg.num_params() == counted == int(exp["num_params"])


def test_router_stats_cover_both_stacks_in_layer_order(case):
    """The runner stacks every layer's router stats in HF layer order (attention and DeltaNet layers interleaved):
    the per-layer top-k counts are transformers', the load-balancing loss its aux_loss, and the trainer's router
    metrics name every layer."""
    _, model, seqs, _, exp, got = case
    stats = got["stats"]
    L = model.cfg.num_layers
    np.testing.assert_array_equal(np.asarray(stats.expert_counts), exp["router_counts"])
    assert np.asarray(stats.tokens).tolist() == [len(seqs[-1])] * L
    np.testing.assert_allclose(float(load_balancing_loss(stats)), float(exp["aux_loss"]), rtol=1e-5)
    metrics = RouterMonitor(capacity=False).observe(1, stats)
    assert {f"router_load_max_l{i}" for i in range(L)} <= set(metrics) and f"router_load_max_l{L}" not in metrics


def test_greedy_generation_equals_transformers(text_case):
    _, model, seqs, _, exp, _ = text_case
    assert generate(model, [seqs[1]], 32) == [exp["greedy"].tolist()]


def test_saved_folder_loads_back(case, tmp_path):
    """save_model writes the published per-expert names (the fixture's text tensors exactly: transformers 5's
    save_pretrained writes them) and loads back equal."""
    name, model, *_ = case
    out = save_model(model, tmp_path / name)
    saved = SafetensorsFile(out / "model.safetensors")
    fixture = SafetensorsFile(FIXTURES / name / "model.safetensors")
    published = {n for n in fixture.names() if "visual" not in n}
    assert set(saved.names()) == published
    assert all(np.array_equal(saved.get(n), fixture.get(n)) for n in published)
    hf = json.loads((out / "config.json").read_text())
    text = hf.get("text_config", hf)
    assert text["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in text
    assert text["shared_expert_intermediate_size"] == 24 and text["num_experts"] == 4
    back = load_model(out, dtype=jnp.float32, attention="xla")
    assert back.cfg == model.cfg


def test_transformers5_fused_expert_names_load(tmp_path):
    """transformers 5's in-memory names (mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]) in both stacks
    load to the same model."""
    d = FIXTURES / "qwen3_5_moe"
    f = SafetensorsFile(d / "model.safetensors")
    t = {n: np.asarray(f.get(n)) for n in f.names()}
    fused = {n: v for n, v in t.items() if ".mlp.experts." not in n}
    for i in range(4):
        p = f"model.language_model.layers.{i}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = np.stack(
            [np.concatenate([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]]) for e in range(4)])
        fused[f"{p}.down_proj"] = np.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    out = tmp_path / "fused"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    write_safetensors(out / "model.safetensors", fused)
    a = nnx.state(load_model(d, dtype=jnp.float32, attention="xla"), nnx.Param)
    b = nnx.state(load_model(out, dtype=jnp.float32, attention="xla"), nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_config_round_trip_and_refusals():
    for name in FAMILIES:
        hf = json.loads((FIXTURES / name / "config.json").read_text())
        cfg = ModelConfig.from_hf(hf)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf = json.loads((FIXTURES / "qwen3_5_moe_text" / "config.json").read_text())
    for key, value in (("norm_topk_prob", False), ("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                       ("intermediate_size", 64), ("shared_expert_intermediate_size", 0)):
        with pytest.raises(ModelConfigError, match=key):
            ModelConfig.from_hf({**hf, key: value})
    assert ModelConfig.from_hf({**hf, "norm_topk_prob": True}).moe.norm_topk_prob


def test_targets_span_both_stacks():
    model = load_model(FIXTURES / "qwen3_5_moe_text", dtype=jnp.float32, attention="xla")
    moe_sites = ("experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                 "shared_expert.down_proj")
    assert model_targets(model) == ("q_proj", "k_proj", "v_proj", "o_proj", *moe_sites,
                                    *(f"linear_layers.{t}" for t in moe_sites + DELTANET))
    assert resolve_model_targets(model, ["experts", "in_proj_qkv"]) == (
        "experts.gate_up_proj", "experts.down_proj", "linear_layers.experts.gate_up_proj",
        "linear_layers.experts.down_proj", "linear_layers.in_proj_qkv")
    with pytest.raises(ValueError, match="not valid on a MoE model.*shared_expert.*in_proj_qkv"):
        resolve_model_targets(model, ["conv1d"])  # the error lists the DeltaNet's names too


def test_lora_over_deltanet_experts_and_shared_expert_trains_and_exports_as_peft(tmp_path):
    """LoRA on attention, the DeltaNet projections, both expert projections and the shared expert, with the routers
    training (train_router): a gradient step lowers the loss, every adapter gets a gradient, the adapter saves
    under PEFT's names (HF layer indices; the experts in PEFT's target_parameters layout; the routers as
    modules_to_save) and loads back into a fresh model with the same loss."""
    d = FIXTURES / "qwen3_5_moe"
    model = load_model(d, dtype=jnp.float32, attention="xla")
    targets = ["q_proj", "experts", "shared_expert", *DELTANET]
    apply_lora(model, targets=targets, rank=2, alpha=4, rngs=nnx.Rngs(0))
    assert make_router_trainable(model, jnp.float32) == 4 * 32 * 4  # both stacks' routers [L, D, E]
    assert len(lora_modules(model)) == 1 + 2 * 5 + 5
    tokens = jnp.asarray(np.load(d / "expected.npz")["tokens2"])[None]
    graphdef, trainable, rest = nnx.split(model, TRAINABLE, ...)

    @jax.jit
    def loss_fn(trainable):
        logits = nnx.merge(graphdef, trainable, rest)(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    loss0, grads = jax.jit(jax.value_and_grad(loss_fn))(trainable)
    flat = dict(nnx.to_flat_state(grads))
    b_grads = {path: g for path, g in flat.items() if path[-1] == "lora_b"}  # A's are 0 while B = 0
    assert len(b_grads) == 16 and all(np.abs(np.asarray(g.get_value())).max() > 0 for g in b_grads.values())
    assert all(np.abs(np.asarray(flat[(s, "mlp", "router", "kernel")].get_value())).max() > 0
               for s in ("layers", "linear_layers"))
    stepped = jax.tree.map(lambda p, g: p - 0.5 * g, trainable, grads)
    assert float(loss_fn(stepped)) < float(loss0)

    nnx.update(model, stepped)
    out = save_peft_adapter(model, tmp_path / "adapter", str(d))
    add_router_to_adapter(model, out)
    names = set(SafetensorsFile(out / WEIGHTS_FILE).names())
    pre = "base_model.model.model.language_model.layers"
    assert f"{pre}.3.self_attn.q_proj.lora_A.weight" in names
    assert f"{pre}.0.linear_attn.in_proj_qkv.lora_B.weight" in names
    assert f"{pre}.3.mlp.experts.base_layer.lora_A.weight" in names  # gate_up_proj, wrapped inside down_proj's
    assert f"{pre}.1.mlp.experts.lora_B.weight" in names and f"{pre}.2.mlp.shared_expert.up_proj.lora_A.weight" in names
    assert {f"{pre}.{i}.mlp.gate.weight" for i in range(4)} <= names
    assert not any("layers.3.linear_attn" in n or "self_attn" in n and ".3." not in n for n in names)
    assert len(names) == 2 * (1 + 5 * 3 + 5 * 4) + 4
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(["q_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                                                       "shared_expert.down_proj", *DELTANET])
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["modules_to_save"] == ["mlp.gate"]  # not "gate": PEFT would also wrap mlp.shared_expert_gate

    fresh = load_model(d, dtype=jnp.float32, attention="xla")
    load_adapter_into(fresh, out, trainable=True)
    assert nnx.split(fresh)[0] == nnx.split(model)[0]  # the loaded adapter and routers sit where the trained ones were
    np.testing.assert_allclose(float(loss_fn(nnx.state(fresh, TRAINABLE))), float(loss_fn(stepped)), atol=1e-6)


def test_vision_tower_is_skipped_with_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="surojax.weights.hf_checkpoint"):
        load_model(FIXTURES / "qwen3_5_moe", dtype=jnp.float32, attention="xla")
    assert any("model.visual." in r.getMessage() for r in caplog.records)


def test_stacks_hold_the_layers_of_their_kind():
    cfg = ModelConfig.from_hf(json.loads((FIXTURES / "qwen3_5_moe_text" / "config.json").read_text()))
    assert stack_layers(cfg, "layers") == (3,) and stack_layers(cfg, "linear_layers") == (0, 1, 2, 4, 5)
