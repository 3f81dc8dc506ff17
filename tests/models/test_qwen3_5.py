"""Qwen3.5 dense and MoE (Gated DeltaNet + gated attention hybrid; the MoE with every layer's MLP the sparse MoE and
a shared expert, in both stacks) against transformers, one module over the four tiny random checkpoints made by
transformers 5.17 (scripts/make_qwen3_5_fixtures.py; tests/fixtures/README.md):

    qwen3_5_text      Qwen3_5ForCausalLM: model.layers.*, 6 layers = one [linear x 3, full] group and a remainder of two
    qwen3_5           Qwen3_5ForConditionalGeneration: model.language_model.*, text_config, 4 layers, a vision tower
                      (loaded beside the text model: tests/models/test_vlm.py runs it), tied head
    qwen3_5_moe_text  Qwen3_5MoeForCausalLM: qwen3_5_text's layers with the MoE
    qwen3_5_moe       Qwen3_5MoeForConditionalGeneration: qwen3_5's layers with the MoE

Every checkpoint: the same fp32 logits (max abs diff <= 1e-4) for a sequence alone, the parameter count, the config
round trip, save-back under the published names. The text checkpoints (the multimodal ones share their code) also
right- and left-padded and packed; 32 greedy tokens = transformers' generate on qwen3_5_moe_text (qwen3_5_text's
decode runs the same hybrid cache and layers but the MLP, which every other family's greedy test decodes). MoE only: the router statistics of
every layer of both stacks in HF layer order (= transformers' per-layer top-k counts; the load-balancing loss = its
aux_loss), both expert weight layouts, the LoRA targets over both stacks, and LoRA over attention, DeltaNet, both
expert projections and the shared expert with trained routers, exported under PEFT's names (peft loading it:
checked once by scripts/check_moe_peft_export.py). The dense LoRA export's names are checked here; its training
and reload against PEFT's own adapter in tests/peft/test_qwen3_5_lora.py (a saved folder loading back in
transformers: scripts/check_transformers_load.py, run once).

One jitted program per checkpoint computes every logits check (the longest sequence alone, the MoE's router stats
for it, and for a text checkpoint one [5, T] batch: row 0 packs the three sequences, rows 1..3 hold each
right-padded, row 4 the longest left-padded)."""
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.generation.loop import generate
from surojax.losses.router import load_balancing_loss
from surojax.models.config import ModelConfig, ModelConfigError
from surojax.models.decoder import layer_pattern, vision_filter
from surojax.models.layer_runner import LayerType
from surojax.models.registry import stack_layers, weight_rows
from surojax.models.targets import model_targets, resolve_model_targets
from surojax.peft.lora import TRAINABLE, apply_lora, lora_modules
from surojax.peft.peft_io import WEIGHTS_FILE, load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.peft.trained_router import add_router_to_adapter, make_router_trainable
from surojax.train.router_monitor import RouterMonitor
from surojax.weights.hf_checkpoint import load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES = ["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"]
TEXT = ["qwen3_5_text", "qwen3_5_moe_text"]  # padding, packing and generation (the multimodal ones share the code)
MULTIMODAL = ["qwen3_5", "qwen3_5_moe"]
MOE = ["qwen3_5_moe_text", "qwen3_5_moe"]
TOL = 1e-4
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def _hf(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(graphdef, state, alone, batch):
    model = nnx.merge(graphdef, state)
    rows = None if batch is None else model(*batch)
    if model.cfg.moe is None:
        return model(alone), rows, None
    # the MoE's router stats from the pass that gives its logits (what model(alone) computes: positions 0..T-1, one
    # segment; its default arguments are the dense checkpoints' path): one pass over the model, not two
    out = model.hidden_states(alone, jnp.arange(alone.shape[1])[None], jnp.ones_like(alone))
    return model.logits(out.hidden), rows, out.router_stats


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
    batch = (jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)) if name in TEXT else None
    alone, rows, stats = _all_logits(graphdef, state, jnp.asarray([seqs[-1]]), batch)
    return name, model, seqs, [exp[f"logits{i}"] for i in range(3)], exp, \
        dict(alone=np.asarray(alone)[0], batch=None if rows is None else np.asarray(rows), starts=starts,
             stats=stats)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    return _case(request.param)


@pytest.fixture(scope="module", params=TEXT)
def text_case(request):
    return _case(request.param)


@pytest.fixture(scope="module", params=MOE)
def moe_case(request):
    return _case(request.param)


@pytest.fixture(scope="module")
def moe_text_case():
    return _case("qwen3_5_moe_text")


def test_config_is_the_hybrid(case):
    name, model, *_ = case
    cfg = model.cfg
    assert cfg.model_type == name and cfg.attn_output_gate and cfg.norm_zero_centered and cfg.qk_norm
    assert cfg.rotary_dim == 4 and cfg.partial_rotary_factor == 0.25
    la = cfg.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (2, 4, 8, 16, 4)
    assert cfg.tie_word_embeddings == (name in MULTIMODAL)
    if name in MOE:
        moe = cfg.moe
        assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size,
                moe.shared_expert_intermediate_size) == (4, 2, 16, 24)
        assert moe.norm_topk_prob and moe.router_aux_loss_coef == 0.02 and cfg.intermediate_size == 0
    else:
        assert cfg.moe is None and cfg.intermediate_size == 48


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
    text = nnx.state(model, nnx.All(nnx.Param, nnx.Not(vision_filter)))  # the multimodal ones hold their tower too
    counted = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(text))
    assert model.cfg.num_params() == counted == int(exp["num_params"])


def test_router_stats_cover_both_stacks_in_layer_order(moe_case):
    """The runner stacks every layer's router stats in HF layer order (attention and DeltaNet layers interleaved):
    the per-layer top-k counts are transformers', the load-balancing loss its aux_loss, and the trainer's router
    metrics name every layer."""
    _, model, seqs, _, exp, got = moe_case
    stats = got["stats"]
    L = model.cfg.num_layers
    np.testing.assert_array_equal(np.asarray(stats.expert_counts), exp["router_counts"])
    assert np.asarray(stats.tokens).tolist() == [len(seqs[-1])] * L
    np.testing.assert_allclose(float(load_balancing_loss(stats)), float(exp["aux_loss"]), rtol=1e-5)
    metrics = RouterMonitor(capacity=False).observe(1, stats)
    assert {f"router_load_max_l{i}" for i in range(L)} <= set(metrics) and f"router_load_max_l{L}" not in metrics


def test_greedy_generation_equals_transformers(moe_text_case):
    """32 greedy tokens through the hybrid cache (prefill by the chunk rule, decode by the recurrent step, the
    attention layers' KV cache, the MoE and shared expert) = transformers' cached greedy generation. (qwen3_5_text's
    decode is this one's but the dense MLP: one checkpoint compiles generate's prefill and decode step.)"""
    _, model, seqs, _, exp, _ = moe_text_case
    assert generate(model, [seqs[1]], 32) == [exp["greedy"].tolist()]


@pytest.mark.parametrize("name", TEXT)
def test_layer_pattern_and_stacks(name):
    """[linear x 3, full] x G from layer_types: the stacks hold the HF layers of their kind in order."""
    cfg = ModelConfig.from_hf(_hf(name))
    pattern = layer_pattern(cfg)
    assert pattern.types == (LayerType("linear_layers"),) * 3 + (LayerType("layers"),)
    assert (pattern.groups, pattern.remainder) == (1, 2)
    assert stack_layers(cfg, "layers") == (3,) and stack_layers(cfg, "linear_layers") == (0, 1, 2, 4, 5)
    with pytest.raises(ValueError, match="stacks are"):
        stack_layers(cfg, "other")


@pytest.mark.parametrize("name", FAMILIES)
def test_config_round_trip(name):
    """config.json -> ModelConfig -> config.json keeps the architecture (text_config nesting, the vision config
    as read, layer types, partial rope, mrope sections)."""
    hf = _hf(name)
    cfg = ModelConfig.from_hf(hf)
    out = cfg.to_hf()
    assert ModelConfig.from_hf(out) == cfg
    text = out.get("text_config", out)
    assert text["rope_parameters"]["mrope_section"] == [1, 1, 0]
    assert text["layer_types"] == (hf.get("text_config") or hf)["layer_types"]
    if name in MULTIMODAL:
        assert out["vision_config"] == hf["vision_config"] and out["architectures"] == hf["architectures"]


@pytest.mark.parametrize("name", TEXT)
def test_bad_configs_are_refused(name):
    hf = _hf(name)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**hf, "layer_types": ["linear_attention", "sliding_attention"] * 3})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        ModelConfig.from_hf({**hf, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="text_config"):  # the multimodal model_type without its text_config
        ModelConfig.from_hf({**hf, "model_type": name.removesuffix("_text")})


def test_moe_keys_asking_for_other_behaviour_are_refused_by_name():
    """qwen3_5_moe's own MoE rules (models/config.py _qwen3_5_moe; qwen2_moe's, which share some key names, are
    tests/models/test_shared_expert.py's): the top-k always renormalised, every layer sparse, a shared expert."""
    hf = _hf("qwen3_5_moe_text")
    for key, value in (("norm_topk_prob", False), ("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                       ("intermediate_size", 64), ("shared_expert_intermediate_size", 0)):
        with pytest.raises(ModelConfigError, match=key):
            ModelConfig.from_hf({**hf, key: value})
    assert ModelConfig.from_hf({**hf, "norm_topk_prob": True}).moe.norm_topk_prob


@pytest.mark.parametrize("name", MULTIMODAL)
def test_vision_tower_loads_with_the_text_model(name, tmp_path):
    """The checkpoint's model.visual.* tensors become the decoder's `visual` tower; the same checkpoint without them
    loads text-only (visual None), as before the tower was modelled."""
    d = FIXTURES / name
    f = SafetensorsFile(d / "model.safetensors")
    assert load_model(d, dtype=jnp.float32, attention="xla").visual is not None
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    write_safetensors(tmp_path / "model.safetensors", {n: f.get(n) for n in f.names() if "visual" not in n})
    assert load_model(tmp_path, dtype=jnp.float32, attention="xla").visual is None


def test_saved_folder_loads_back(case, tmp_path):
    """save_model writes the published names (the fixture's text tensors exactly; the MoE's per-expert names, as
    transformers 5's save_pretrained writes them) and its config, and loads back equal."""
    name, model, *_ = case
    out = save_model(model, tmp_path / name)
    saved = SafetensorsFile(out / "model.safetensors")
    fixture = SafetensorsFile(FIXTURES / name / "model.safetensors")
    published = set(fixture.names())  # the vision tower's tensors too
    assert set(saved.names()) == published
    assert all(np.array_equal(saved.get(n), fixture.get(n)) for n in published)
    hf = json.loads((out / "config.json").read_text())
    text = hf.get("text_config", hf)
    assert text["model_type"] == name.removesuffix("_text") + "_text"
    if name in MOE:
        assert "intermediate_size" not in text
        assert text["shared_expert_intermediate_size"] == 24 and text["num_experts"] == 4
    back = load_model(out, dtype=jnp.float32, attention="xla")
    assert back.cfg == model.cfg
    a, b = nnx.state(model, nnx.Param), nnx.state(back, nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


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


def test_lora_on_the_deltanet_exports_under_peft_names(tmp_path):
    """LoRA on the DeltaNet projections and the MLP (both stacks) of the dense model: the adapter saves under
    PEFT's names (HF layer indices, the DeltaNet targets only on DeltaNet layers) and its config, and reads back
    into our stacked rows. (Training it, and the PEFT names of every all-linear target against PEFT's own adapter:
    tests/peft/test_qwen3_5_lora.py.)"""
    d = FIXTURES / "qwen3_5_text"
    model = load_model(d, dtype=jnp.float32, attention="xla")
    apply_lora(model, targets=list(DELTANET) + ["gate_proj"], rank=4, alpha=8, rngs=nnx.Rngs(0))
    assert set(lora_modules(model)) == {"gate_proj", "linear_layers.gate_proj",
                                        *(f"linear_layers.{t}" for t in DELTANET)}
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


def test_moe_targets_span_both_stacks():
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


def test_moe_lora_over_deltanet_experts_and_shared_expert_trains_and_exports_as_peft(tmp_path):
    """LoRA on attention, the DeltaNet projections, both expert projections and the shared expert, with the routers
    training (train_router): a gradient step lowers the loss, every adapter gets a gradient, the adapter saves
    under PEFT's names (HF layer indices; the experts in PEFT's target_parameters layout; the routers as
    modules_to_save) and loads back into a fresh model with the same loss. Every loss comes from the one compiled
    value-and-gradient program."""
    d = FIXTURES / "qwen3_5_moe"
    model = load_model(d, dtype=jnp.float32, attention="xla")
    targets = ["q_proj", "experts", "shared_expert", *DELTANET]
    apply_lora(model, targets=targets, rank=2, alpha=4, rngs=nnx.Rngs(0))
    assert make_router_trainable(model, jnp.float32) == 4 * 32 * 4  # both stacks' routers [L, D, E]
    assert len(lora_modules(model)) == 1 + 2 * 5 + 5
    tokens = jnp.asarray(np.load(d / "expected.npz")["tokens2"])[None]
    graphdef, trainable, rest = nnx.split(model, TRAINABLE, ...)

    def loss_fn(trainable):
        logits = nnx.merge(graphdef, trainable, rest)(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    loss0, grads = value_and_grad(trainable)
    flat = dict(nnx.to_flat_state(grads))
    b_grads = {path: g for path, g in flat.items() if path[-1] == "lora_b"}  # A's are 0 while B = 0
    assert len(b_grads) == 16 and all(np.abs(np.asarray(g.get_value())).max() > 0 for g in b_grads.values())
    assert all(np.abs(np.asarray(flat[(s, "mlp", "router", "kernel")].get_value())).max() > 0
               for s in ("layers", "linear_layers"))
    stepped = jax.tree.map(lambda p, g: p - 0.5 * g, trainable, grads)
    loss1 = float(value_and_grad(stepped)[0])
    assert loss1 < float(loss0)

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
    np.testing.assert_allclose(float(value_and_grad(nnx.state(fresh, TRAINABLE))[0]), loss1, atol=1e-6)
