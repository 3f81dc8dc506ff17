"""Gemma 4 text (`gemma4_text`, and the text backbone of the multimodal `gemma4`; the dense text model) beyond the
logits parity of tests/models/test_hf_parity.py (fp32 logits alone / padded / packed and 32 greedy tokens =
transformers, over the fixtures of scripts/make_gemma4_fixtures.py: 6 layers [sliding x 2, full] x 2, window 4,
the full layers' proportional rope, v norm, softmax scale 1, layer scalars): the config's reading (what is not built
yet is refused by name: per-layer input embeddings, KV-shared layers, attention_k_eq_v, the MoE block, wider
full-attention layers), the logits' soft-capping against transformers, the proportional rope's frequencies against transformers' formula, the
multimodal checkpoint (vision tower skipped with a log line), save -> load, the LoRA targets' PEFT names."""
import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from surojax.models.config import GlobalAttention, ModelConfig, ModelConfigError, rope_inv_freq
from surojax.models.decoder import layer_pattern
from surojax.models.layer_runner import LayerPattern, LayerType
from surojax.models.registry import stack_layers
from surojax.models.targets import model_targets, resolve_model_targets
from surojax.peft.lora import apply_lora
from surojax.peft.peft_io import WEIGHTS_FILE, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.peft.trained_router import make_router_trainable
from surojax.weights.hf_checkpoint import load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile
from tests.models.test_lfm2 import lora_b_grads

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES = ["gemma4_text", "gemma4"]
# + the MoE block; + full layers of their own shape; + those with per-layer inputs and KV-shared layers
WITH_MOE = FAMILIES + ["gemma4_text_moe", "gemma4_text_global", "gemma4_text_shared"]  # gemma4_text with its MoE block (enable_moe_block)


@functools.partial(jax.jit, static_argnums=0)
def _jitted_forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def _forward(model, tokens: np.ndarray) -> np.ndarray:
    """model(tokens [T]) -> logits [T, V], jitted (eager, each op of the forward compiles on its own); models of
    one structure share the program."""
    return np.asarray(_jitted_forward(*nnx.split(model), jnp.asarray(tokens)[None]))[0]


def _hf(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _text(hf: dict) -> dict:
    return hf.get("text_config", hf)


def _with(name: str, **changes) -> dict:
    hf = _hf(name)
    return hf | {"text_config": _text(hf) | changes} if "text_config" in hf else hf | changes


@pytest.mark.parametrize("name", FAMILIES)
def test_config_reads_the_gemma4_keys(name):
    cfg = ModelConfig.from_hf(_hf(name))
    assert cfg.model_type == name and cfg.tie_word_embeddings and cfg.qk_norm and not cfg.norm_zero_centered
    assert cfg.sandwich_norms and cfg.scale_embeddings and cfg.v_norm and cfg.layer_scalar
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.query_pre_attn_scalar == 1.0
    assert cfg.sliding_window == 4 and cfg.layer_windows == (4, 4, None) * 2
    rs = cfg.rope_scaling
    assert (cfg.rope_theta, rs.rope_type, rs.partial_rotary_factor) == (100.0, "proportional", 0.5)
    assert (cfg.local_rope_theta, cfg.local_rope_scaling.rope_type) == (1e4, "default")
    assert layer_pattern(cfg) == LayerPattern((LayerType("layers", (("window", 4), ("rope", 1))),) * 2
                                              + (LayerType("layers", (("window", 0), ("rope", 0))),), 6)
    assert cfg.num_params() == int(np.load(FIXTURES / name / "expected.npz")["num_params"])


def test_proportional_rope_frequencies_are_transformers_formula():
    """transformers' _compute_proportional_rope_parameters: int(p * H // 2) frequencies base ** (-2i / H) over the
    whole head, the rest 0, all / factor (H 16, p 0.5 -> 4 of 8; a p that does not divide evenly floors)."""
    cfg = ModelConfig.from_hf(_hf("gemma4_text"))
    np.testing.assert_allclose(rope_inv_freq(cfg), [100.0 ** (-i / 16) for i in range(0, 8, 2)] + [0.0] * 4)
    rp = _text(_hf("gemma4_text"))["rope_parameters"]
    odd = rp | {"full_attention": rp["full_attention"] | {"partial_rotary_factor": 0.3, "factor": 2.0}}
    cfg = ModelConfig.from_hf(_with("gemma4_text", rope_parameters=odd))
    np.testing.assert_allclose(rope_inv_freq(cfg), [100.0 ** (-i / 16) / 2 for i in range(0, 4, 2)] + [0.0] * 6)


def test_defaults_read_as_transformers_builds_them():
    """Without layer_types every 6th layer is full attention and the last layer is forced to full attention;
    without rope_parameters the full layers' rope is proportional (0.25, 1e6), the sliding ones' default 1e4."""
    hf = {k: v for k, v in _hf("gemma4_text").items() if k not in ("layer_types", "rope_parameters")}
    cfg = ModelConfig.from_hf(hf | {"num_hidden_layers": 8})
    assert cfg.layer_windows == (4, 4, 4, 4, 4, None, 4, None)
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.partial_rotary_factor) == \
        (1e6, "proportional", 0.25)
    assert (cfg.local_rope_theta, cfg.local_rope_scaling.rope_type) == (1e4, "default")


@pytest.mark.parametrize("key, value, match", [
    ("hidden_size_per_layer_input", -1, "hidden_size_per_layer_input -1 must be a non-negative integer"),
    ("num_kv_shared_layers", 6, "num_kv_shared_layers 6 must leave at least one layer"),
    ("num_kv_shared_layers", 1.5, "num_kv_shared_layers 1.5 must be a non-negative integer"),
    ("enable_moe_block", True, "enable_moe_block true needs num_experts, top_k_experts, moe_intermediate_size"),
    ("final_logit_softcapping", -1.0, "final_logit_softcapping -1.0 must be a positive number"),
    ("per_layer_config", {"1": {"head_dim": 32}}, "overrides layer 1, not a full_attention layer"),
    ("per_layer_config", {"2": {"intermediate_size": 32}}, "sets \\['intermediate_size'\\]"),
    ("per_layer_config", {"2": {"head_dim": 32}}, "different shapes"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("query_pre_attn_scalar", 256, "query_pre_attn_scalar is not read"),
    ("hidden_act", "silu", "hidden_act 'silu' differs from hidden_activation"),
    ("attention_bias", True, "attention_bias"),
])
@pytest.mark.parametrize("name", FAMILIES)
def test_unsupported_keys_are_refused_by_name(name, key, value, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf(_with(name, **{key: value}))


def test_moe_block_config():
    """enable_moe_block: the MoE beside the MLP, transformers' router (softmax top-k renormalised, per-expert scales,
    the input norm with Gemma's eps) and GeGLU experts; the block's parameters counted as transformers counts them
    (test_hf_parity checks the logits and greedy tokens)."""
    cfg = ModelConfig.from_hf(_hf("gemma4_text_moe"))
    moe = cfg.moe
    assert cfg.moe_beside_mlp and cfg.intermediate_size == 64 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (4, 2, 16)
    assert (moe.router, moe.norm_topk_prob, moe.norm_topk_eps, moe.activation) == ("softmax_topk", True, 0.0, "geglu")
    assert moe.per_expert_scale and moe.router_input_norm == 1e-6 and not moe.selection_bias
    assert cfg.num_params() == int(np.load(FIXTURES / "gemma4_text_moe" / "expected.npz")["num_params"])
    with pytest.raises(ModelConfigError, match="needs top_k_experts"):
        ModelConfig.from_hf(_with("gemma4_text_moe", top_k_experts=None))


def test_missing_keys_take_transformers_defaults_and_are_refused():
    """No hidden_size_per_layer_input: transformers' default 256 (PLE on); a KV-shared layer whose kind has no
    earlier layer to read is refused (transformers would fail in its forward); no per_layer_config: the full layers'
    head_dim is global_head_dim, default 512, and their kv heads num_global_key_value_heads only with
    attention_k_eq_v (the published checkpoints' spelling, as transformers' Gemma4TextConfig reads it)."""
    text = _hf("gemma4_text")
    ple = ModelConfig.from_hf({k: v for k, v in text.items() if k != "hidden_size_per_layer_input"})
    assert (ple.per_layer_input_size, ple.per_layer_vocab_size) == (256, 256)
    with pytest.raises(ModelConfigError, match="KV-shared layer 5 \\(full_attention\\) has no earlier layer"):
        ModelConfig.from_hf(text | {"num_kv_shared_layers": 3, "layer_types": ["sliding_attention"] * 5
                                    + ["full_attention"], "per_layer_config": {}})
    without = {k: v for k, v in text.items() if k != "per_layer_config"}
    assert ModelConfig.from_hf(without).global_attention == GlobalAttention(512, 2, False)
    assert ModelConfig.from_hf(without | {"global_head_dim": 16}) == ModelConfig.from_hf(text)
    assert ModelConfig.from_hf(without | {"global_head_dim": 16, "num_global_key_value_heads": 1}) \
        == ModelConfig.from_hf(text)  # not read without attention_k_eq_v
    with pytest.raises(ModelConfigError, match="global_head_dim None must be a positive integer"):
        ModelConfig.from_hf(without | {"global_head_dim": None})
    published = ModelConfig.from_hf(without | {"global_head_dim": 32, "num_global_key_value_heads": 1,
                                               "attention_k_eq_v": True})
    assert published == ModelConfig.from_hf(_hf("gemma4_text_global"))


def test_global_layers_config_and_stack():
    """Full layers of their own shape (gemma4_text_global: per_layer_config head_dim 32, 1 kv head, k = v): the
    `global_layers` stack holds HF layers 2 and 5, built without v_proj; the full rope spans 32 dims; the
    parameters counted as transformers counts them. A model of full layers only takes their shape as its own."""
    cfg = ModelConfig.from_hf(_hf("gemma4_text_global"))
    assert cfg.global_attention == GlobalAttention(32, 1, True) and (cfg.head_dim, cfg.num_kv_heads) == (16, 2)
    assert layer_pattern(cfg) == LayerPattern((LayerType("layers", (("window", 4), ("rope", 1))),) * 2
                                              + (LayerType("global_layers", (("window", 0), ("rope", 0))),), 6)
    assert stack_layers(cfg, "layers") == (0, 1, 3, 4) and stack_layers(cfg, "global_layers") == (2, 5)
    assert cfg.num_params() == int(np.load(FIXTURES / "gemma4_text_global" / "expected.npz")["num_params"])
    full, local = cfg.rope_configs()
    assert (full.head_dim, local.head_dim, len(rope_inv_freq(full))) == (32, 16, 16)
    model = load_model(FIXTURES / "gemma4_text_global", dtype=jnp.float32, attention="xla")
    assert model.global_layers.attn.v_proj is None and model.layers.attn.v_proj is not None
    assert model.global_layers.attn.q_proj.kernel.shape == (2, 32, 4 * 32)
    assert model.global_layers.attn.k_proj.kernel.shape == (2, 32, 32)
    text = {k: v for k, v in _hf("gemma4_text_global").items() if k != "per_layer_config"}
    only_full = ModelConfig.from_hf(text | {"layer_types": ["full_attention"] * 6, "global_head_dim": 32,
                                            "num_global_key_value_heads": 1})
    assert only_full.global_attention is None and only_full.attention_k_eq_v
    assert (only_full.head_dim, only_full.num_kv_heads) == (32, 1)
    assert ModelConfig.from_hf(only_full.to_hf()) == only_full


@pytest.mark.parametrize("name", WITH_MOE)
def test_config_round_trip(name):
    """config.json -> ModelConfig -> config.json: the same architecture, the unbuilt features written off."""
    hf = _hf(name)
    cfg = ModelConfig.from_hf(hf)
    out = cfg.to_hf()
    assert ModelConfig.from_hf(out) == cfg
    text = _text(out)
    for key in ("layer_types", "rope_parameters", "hidden_activation", "sliding_window", "final_logit_softcapping",
                "head_dim", "intermediate_size", "hidden_size_per_layer_input", "num_kv_shared_layers",
                "attention_k_eq_v", "enable_moe_block", "per_layer_config") + (
                    ("num_experts", "top_k_experts", "moe_intermediate_size") if cfg.moe else ()):
        assert text[key] == _text(hf)[key], key
    assert "query_pre_attn_scalar" not in text and "hidden_act" not in text
    if name == "gemma4":
        assert out["vision_config"] == hf["vision_config"] and text["model_type"] == "gemma4_text"


@pytest.mark.parametrize("name", FAMILIES)
def test_softcapped_logits_equal_transformers(name, tmp_path):
    """final_logit_softcapping 2 (expected.npz softcap_logits2: transformers with the cap set) is read, written
    back, and caps the logits."""
    exp = np.load(FIXTURES / name / "expected.npz")
    (tmp_path / "config.json").write_text(json.dumps(_with(name, final_logit_softcapping=float(exp["softcap"]))))
    (tmp_path / "model.safetensors").symlink_to(FIXTURES / name / "model.safetensors")
    model = load_model(tmp_path, dtype=jnp.float32, attention="xla")
    assert model.cfg.final_logit_softcapping == 2.0 and _text(model.cfg.to_hf())["final_logit_softcapping"] == 2.0
    got = _forward(model, exp["tokens2"])
    assert np.abs(got - exp["softcap_logits2"]).max() <= 1e-4
    assert np.abs(got - exp["logits2"]).max() > 0.1


def test_vision_tower_is_skipped_with_a_log_line(caplog):
    d = FIXTURES / "gemma4"
    names = SafetensorsFile(d / "model.safetensors").names()
    vision = sum(n.startswith(("model.vision_tower.", "model.embed_vision.")) for n in names)
    assert vision > 0
    with caplog.at_level(logging.INFO, logger="surojax.weights.hf_checkpoint"):
        load_model(d, dtype=jnp.float32, attention="xla")
    assert any(f"skipping {vision} tensors" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", WITH_MOE)
def test_saved_folder_loads_back(name, tmp_path):
    """save_model writes the text tensors under the fixture's names (layer scalars included), the same bits; the
    folder loads back equal."""
    model = load_model(FIXTURES / name, dtype=jnp.float32, attention="xla")
    out = save_model(model, tmp_path / name)
    saved = SafetensorsFile(out / "model.safetensors")
    fixture = SafetensorsFile(FIXTURES / name / "model.safetensors")
    text = [n for n in fixture.names() if not n.startswith(("model.vision_tower.", "model.embed_vision."))]
    assert set(saved.names()) == set(text) and any(n.endswith("layers.5.layer_scalar") for n in text)
    assert all(np.array_equal(saved.get(n), fixture.get(n)) for n in text)
    back = load_model(out, dtype=jnp.float32, attention="xla")
    assert back.cfg == model.cfg
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 nnx.state(model, nnx.Param), nnx.state(back, nnx.Param))


def test_lora_targets_export_under_peft_names(tmp_path):
    model = load_model(FIXTURES / "gemma4", dtype=jnp.float32, attention="xla")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert model_targets(model) == targets
    apply_lora(model, targets=list(targets), rank=2, alpha=4, rngs=nnx.Rngs(0))
    out = save_peft_adapter(model, tmp_path / "adapter", str(FIXTURES / "gemma4"))
    names = set(SafetensorsFile(out / WEIGHTS_FILE).names())
    assert len(names) == 2 * 7 * 6
    assert "base_model.model.model.language_model.layers.5.mlp.down_proj.lora_B.weight" in names


def test_moe_block_lora_targets_train_and_export(tmp_path):
    """With the MoE block: the dense names (gate / up / down_proj are the dense MLP's) and the experts' fused
    projections (`experts`, as the other MoE families name them), every adapter trained; exported in PEFT's layout
    (`target_parameters` experts.gate_up_proj / experts.down_proj: transformers' module is `layers.{i}.experts`;
    against PEFT's own adapter in tests/peft/test_moe_family_lora.py); training its router is refused."""
    model = load_model(FIXTURES / "gemma4_text_moe", dtype=jnp.float32, attention="xla")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts.gate_up_proj",
             "experts.down_proj")
    assert model_targets(model) == every == resolve_model_targets(model, "all-linear")
    assert resolve_model_targets(model, ["down_proj", "experts"]) == ("down_proj", *every[-2:])
    with pytest.raises(ValueError, match="not valid on Gemma 4 with its MoE block"):
        resolve_model_targets(model, ["shared_expert"])
    apply_lora(model, targets="all-linear", rank=2, alpha=4, rngs=nnx.Rngs(0))
    b_grads = lora_b_grads(model, np.load(FIXTURES / "gemma4_text_moe" / "expected.npz")["tokens2"])
    assert len(b_grads) == len(every) and all(np.abs(g).max() > 0 for g in b_grads)
    out = save_peft_adapter(model, tmp_path / "adapter", str(FIXTURES / "gemma4_text_moe"))
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    names = SafetensorsFile(out / WEIGHTS_FILE).names()
    assert "base_model.model.model.layers.5.experts.base_layer.lora_A.weight" in names  # gate_up_proj, nested
    assert "base_model.model.model.layers.5.mlp.down_proj.lora_B.weight" in names  # the dense MLP's
    with pytest.raises(ValueError, match="train_router: Gemma 4's MoE-block router"):
        make_router_trainable(model, jnp.float32)


def test_shared_layers_and_per_layer_inputs_config():
    """gemma4_text_shared: the last 2 layers KV-shared (layer 4, sliding, reads layer 3's keys / values; layer 5,
    full, layer 2's), in stacks of their own without k / v projections, their MLPs double-wide, their KV rows in
    the cache part of their shape; per-layer inputs of 8 per layer; parameters as transformers counts them."""
    cfg = ModelConfig.from_hf(_hf("gemma4_text_shared"))
    assert (cfg.kv_shared_layers, cfg.double_wide_mlp, cfg.per_layer_input_size) == (2, True, 8)
    assert [cfg.kv_source(i) for i in (4, 5)] == [3, 2]
    assert [cfg.layer_stack(i) for i in range(6)] == ["layers", "layers", "global_layers", "layers",
                                                      "shared_layers", "shared_global_layers"]
    types = layer_pattern(cfg).types
    assert len(types) == 6 and types[3].kwargs["kv_store"] == "sliding_attention"
    assert types[2].kwargs["kv_store"] == "full_attention" and "kv_store" not in types[0].kwargs
    assert (types[4].kwargs["kv_from"], types[4].cache_part) == ("sliding_attention", "layers")
    assert (types[5].kwargs["kv_from"], types[5].cache_part) == ("full_attention", "global_layers")
    assert cfg.num_params() == int(np.load(FIXTURES / "gemma4_text_shared" / "expected.npz")["num_params"])
    model = load_model(FIXTURES / "gemma4_text_shared", dtype=jnp.float32, attention="xla")
    shared = model.shared_global_layers
    assert shared.attn.k_proj is None and shared.attn.v_proj is None and shared.attn.k_norm is None
    assert shared.mlp.gate_proj.kernel.shape == (1, 32, 128) and model.layers.mlp.gate_proj.kernel.shape[-1] == 64
    assert model.embed_per_layer.embedding.shape == (256, 48) and model.layers.ple_gate.kernel.shape == (3, 32, 8)


def test_gemma4_stacks_lora_targets_train_and_export(tmp_path):
    """LoRA on Gemma 4's stacks (gemma4_text_shared: `layers`, `global_layers` without v_proj, the KV-shared
    `shared_layers` / `shared_global_layers` without k_proj / v_proj): the standard names in each stack that has
    the module, every adapter trained; exported under PEFT's names on transformers' model (one adapter per module of
    model.layers.{i}, as the checkpoint's own tensor names list the modules), and read back (load_adapter_into) into
    a fresh model to the same logits. (PEFT itself loads the export onto transformers' model to the same logits: a
    one-off check in the reference env, tests/fixtures/README.md.)"""
    d = FIXTURES / "gemma4_text_shared"
    model = load_model(d, dtype=jnp.float32, attention="xla")
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    every = names + tuple(f"global_layers.{n}" for n in names if n != "v_proj") + tuple(
        f"{stack}.{n}" for stack in ("shared_layers", "shared_global_layers") for n in names
        if n not in ("k_proj", "v_proj"))
    assert model_targets(model) == every == resolve_model_targets(model, "all-linear")
    assert resolve_model_targets(model, ["v_proj", "k_proj"]) == ("k_proj", "v_proj", "global_layers.k_proj")
    apply_lora(model, targets="all-linear", rank=2, alpha=4, rngs=nnx.Rngs(0))
    tokens = np.load(d / "expected.npz")["tokens2"]
    assert all(np.abs(g).max() > 0 for g in lora_b_grads(model, tokens))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # B away from zero: the logits move
        if path[-1] == "lora_b":
            var.set_value(jax.random.normal(jax.random.key(len(path)), var.get_value().shape) * 0.1)
    out = save_peft_adapter(model, tmp_path / "adapter", str(d))
    saved = set(SafetensorsFile(out / WEIGHTS_FILE).names())
    modules = [n.removesuffix(".weight") for n in SafetensorsFile(d / "model.safetensors").names()
               if n.endswith("_proj.weight")]
    assert saved == {f"base_model.model.{m}.lora_{ab}.weight" for m in modules for ab in "AB"}
    assert not any("layers.2.self_attn.v_proj" in n or "layers.4.self_attn.k_proj" in n for n in saved)
    again = load_adapter_into(load_model(d, dtype=jnp.float32, attention="xla"), out, trainable=True)
    np.testing.assert_allclose(_forward(again, tokens), _forward(model, tokens), atol=1e-5)


def test_shared_layers_unused_kv_tensors_are_ignored_with_a_log_line(tmp_path, caplog):
    """A checkpoint holding k / v projections and norms for its KV-shared layers (transformers ignores them:
    Gemma4TextModel._keys_to_ignore_on_load_unexpected) loads, the tensors skipped with a log line."""
    d = FIXTURES / "gemma4_text_shared"
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: f.get(n) for n in f.names()}
    extra = {f"model.layers.4.self_attn.{m}.weight": np.ones(shape, np.float32)
             for m, shape in (("k_proj", (32, 32)), ("v_proj", (32, 32)), ("k_norm", (16,)), ("v_norm", (16,)))}
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    save_file(tensors | extra, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="surojax.weights.hf_checkpoint"):
        model = load_model(tmp_path, dtype=jnp.float32, attention="xla")
    assert any("ignoring 4 k / v tensors of KV-shared layers" in r.getMessage() for r in caplog.records)
    exp = np.load(d / "expected.npz")
    assert np.abs(_forward(model, exp["tokens0"]) - exp["logits0"]).max() <= 1e-4
