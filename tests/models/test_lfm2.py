"""LFM2 (short-convolution layers beside GQA attention layers) against transformers, over two tiny random checkpoints
made by transformers 5.17 (scripts/make_lfm2_fixtures.py; tests/fixtures/README.md):

    lfm2            6 layers [conv, conv, full, conv, full, conv] from layer_types, tied, no conv bias, conv_L_cache 3,
                    the feed-forward width from block_auto_adjust_ff_dim (100 -> 112)
    lfm2_conv_bias  an older config.json: full_attn_idxs [1] over 3 layers, block_ff_dim, tie_embedding false,
                    conv_bias (in_proj, conv and out_proj biases), conv_L_cache 4, no width adjustment

Both: the same fp32 logits (max abs diff <= 1e-4) alone, right- and left-padded and packed (the conv starts fresh at
each segment), 32 greedy tokens = transformers' cached generation (prefill, then the conv state carried by the cache
through decode), the parameter count, the config round trip, save-back under the published names. LoRA over every
Linear (LFM2's HF target names) exported under PEFT's names. One jitted program per checkpoint computes every logits
check (the longest sequence alone and a [5, T] batch: row 0 packs the three sequences, rows 1..3 hold each
right-padded, row 4 the longest left-padded)."""
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.generation.loop import empty_cache, generate
from surojax.models.config import ModelConfig, ModelConfigError, lfm2_ff_dim
from surojax.models.decoder import layer_pattern
from surojax.models.layer_runner import CarriedCacheScan, LayerType
from surojax.models.registry import stack_layers, weight_rows
from surojax.models.targets import model_targets, resolve_model_targets
from surojax.peft.lora import TRAINABLE, apply_lora, lora_modules
from surojax.peft.peft_io import WEIGHTS_FILE, load_peft_adapter, save_peft_adapter
from surojax.peft.trained_router import make_router_trainable
from surojax.quant.model import is_quantized, quantize_model
from surojax.weights.hf_checkpoint import load_model, save_model
from surojax.weights.safetensors_file import SafetensorsFile
from tests.models.test_qwen3_5 import _batch

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
# lfm2_moe, lfm2_moe_dense (its dense leading layers): scripts/make_lfm2_moe_fixtures.py
FAMILIES = ["lfm2", "lfm2_conv_bias", "lfm2_moe", "lfm2_moe_dense"]
DENSE = FAMILIES[:2]
TOL = 1e-4


def _hf(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(graphdef, state, alone, batch):
    model = nnx.merge(graphdef, state)
    return model(alone), model(*batch)


@functools.cache
def _case(name: str):
    exp = np.load(FIXTURES / name / "expected.npz")
    seqs = [exp[f"tokens{i}"].tolist() for i in range(3)]
    model = load_model(FIXTURES / name, dtype=jnp.float32, attention="xla")
    tokens, pos, seg, starts = _batch(seqs)
    graphdef, state = nnx.split(model)
    alone, rows = _all_logits(graphdef, state, jnp.asarray([seqs[-1]]),
                              (jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))
    return model, seqs, [exp[f"logits{i}"] for i in range(3)], exp, \
        dict(alone=np.asarray(alone)[0], batch=np.asarray(rows), starts=starts)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    return _case(request.param)


def test_config_is_lfm2():
    cfg, old = ModelConfig.from_hf(_hf("lfm2")), ModelConfig.from_hf(_hf("lfm2_conv_bias"))
    assert cfg.model_type == old.model_type == "lfm2" and cfg.qk_norm and not cfg.norm_zero_centered
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.head_dim, cfg.linear_attention) == (1e6, 1e-5, 8, None)
    assert cfg.tie_word_embeddings and not old.tie_word_embeddings  # the family default; tie_embedding false
    assert (cfg.intermediate_size, old.intermediate_size) == (112, 40)  # auto-adjusted; block_ff_dim as is
    assert cfg.short_conv.layers == (True, True, False, True, False, True) and cfg.short_conv.kernel == 3
    assert old.short_conv.layers == (True, False, True) and old.short_conv.kernel == 4 and old.short_conv.bias
    assert cfg.num_attention_layers == 2 and stack_layers(cfg, "conv_layers") == (0, 1, 3, 5)
    assert layer_pattern(old).types == (LayerType("conv_layers"), LayerType("layers"))


def test_feed_forward_width_is_transformers_rule():
    """Lfm2MLP: int(2 I / 3), then int(multiplier * it) rounded up to block_multiple_of; a null multiplier skips
    the second step; no adjustment at all with block_auto_adjust_ff_dim false."""
    assert lfm2_ff_dim({"intermediate_size": 12288}) == 8192  # LFM2-1.2B: 12288 -> 8192 (multiple of 256)
    assert lfm2_ff_dim({"intermediate_size": 100, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 16}) == 112
    assert lfm2_ff_dim({"intermediate_size": 100, "block_ffn_dim_multiplier": None}) == 66
    assert lfm2_ff_dim({"intermediate_size": 100, "block_auto_adjust_ff_dim": False}) == 100


def test_a_sequence_alone(case):
    _, _, logits, _, got = case
    np.testing.assert_allclose(got["alone"], logits[-1], atol=TOL, rtol=0)


def test_right_padded(case):
    _, seqs, logits, _, got = case
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(got["batch"][1 + i, :len(s)], logits[i], atol=TOL, rtol=0)


def test_left_padded(case):
    """Padding before the sequence: the conv starts fresh at the sequence (no tap reads padding)."""
    _, seqs, logits, _, got = case
    np.testing.assert_allclose(got["batch"][-1, -len(seqs[-1]):], logits[-1], atol=TOL, rtol=0)


def test_packed(case):
    """Three documents in one row compute what each computes alone: the conv resets at each segment."""
    _, seqs, logits, _, got = case
    for i, s in enumerate(seqs):
        at = got["starts"][i]
        np.testing.assert_allclose(got["batch"][0, at:at + len(s)], logits[i], atol=TOL, rtol=0)


def test_parameter_count(case):
    """transformers' count; lfm2_moe's expert_bias is a buffer there (a parameter here, left out of the count)."""
    model, _, _, exp, _ = case
    counted = sum(int(np.prod(v.get_value().shape)) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                  if path[-1] != "selection_bias")
    assert model.cfg.num_params() == counted == int(exp["num_params"])


@pytest.mark.parametrize("name", ["lfm2", "lfm2_conv_bias", "lfm2_moe_dense"])
def test_greedy_generation_equals_transformers(name):
    """32 greedy tokens through the hybrid cache (the attention layers' KV, the conv layers' last K - 1 inputs),
    in a batch beside a longer and a shorter prompt = transformers' cached greedy generation. (lfm2_moe's decode is
    lfm2_moe_dense's sparse layers, the same conv, attention and MoE code: one checkpoint compiles it.)"""
    model, seqs, _, exp, _ = _case(name)
    assert generate(model, [seqs[2], seqs[1], seqs[0]], 32)[1] == exp["greedy"].tolist()


@pytest.mark.parametrize("name", DENSE)
def test_config_round_trip(name):
    """config.json -> ModelConfig -> config.json keeps the architecture; the older aliases are written in today's
    spelling (block_ff_dim would override intermediate_size in transformers)."""
    hf = _hf(name)
    cfg = ModelConfig.from_hf(hf)
    out = cfg.to_hf()
    assert ModelConfig.from_hf(out) == cfg
    assert out["norm_eps"] == 1e-5 and out["conv_L_cache"] == cfg.short_conv.kernel
    assert out["layer_types"] == hf.get("layer_types", ["conv", "full_attention", "conv"])
    assert "block_ff_dim" not in out and "tie_embedding" not in out
    if name == "lfm2":  # the read width keys still give the width: kept as read
        assert (out["intermediate_size"], out["block_auto_adjust_ff_dim"]) == (100, True)
    changed = cfg.replace(intermediate_size=64).to_hf()  # a width the read keys do not give: written as it is
    assert (changed["intermediate_size"], changed["block_auto_adjust_ff_dim"]) == (64, False)
    assert ModelConfig.from_hf(changed).intermediate_size == 64


def test_bad_configs_are_refused():
    hf = _hf("lfm2")
    with pytest.raises(ModelConfigError, match="layer_types.*sliding_attention"):
        ModelConfig.from_hf({**hf, "layer_types": ["conv", "sliding_attention"] * 3})
    with pytest.raises(ModelConfigError, match="layer_types has 2 entries"):
        ModelConfig.from_hf({**hf, "layer_types": ["conv", "full_attention"]})
    with pytest.raises(ModelConfigError, match="conv_L_cache 1"):
        ModelConfig.from_hf({**hf, "conv_L_cache": 1})


def test_saved_folder_loads_back(case, tmp_path):
    """save_model writes the published names (the fixture's tensors exactly) and loads back equal."""
    model, *_ = case
    name = ("lfm2_moe_dense" if model.cfg.dense_layers else "lfm2_moe") if model.cfg.moe else \
        "lfm2" if model.cfg.tie_word_embeddings else "lfm2_conv_bias"
    out = save_model(model, tmp_path / name)
    saved, fixture = SafetensorsFile(out / "model.safetensors"), SafetensorsFile(FIXTURES / name / "model.safetensors")
    assert set(saved.names()) == set(fixture.names())
    assert all(np.array_equal(saved.get(n), fixture.get(n)) for n in fixture.names())
    back = load_model(out, dtype=jnp.float32, attention="xla")
    assert back.cfg == model.cfg


def test_lora_targets_and_peft_export(tmp_path):
    """LoRA over every Linear, asked for in LFM2's HF names: the attention in `layers`, the conv's in_proj /
    out_proj in `conv_layers`, the MLP in both. The adapter saves under PEFT's names (HF layer indices) with
    target_modules PEFT matches on this model, and reads back into our stacked rows."""
    d = FIXTURES / "lfm2"
    model = load_model(d, dtype=jnp.float32, attention="xla")
    mlp = ("gate_proj", "up_proj", "down_proj")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", *mlp, *(f"conv_layers.{t}" for t in mlp),
             "conv_layers.conv.in_proj", "conv_layers.conv.out_proj")
    assert model_targets(model) == every
    hf_names = ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"]
    assert resolve_model_targets(model, hf_names) == every == resolve_model_targets(model, "all-linear")
    assert resolve_model_targets(model, ["w1", "in_proj"]) == ("gate_proj", "conv_layers.gate_proj",
                                                               "conv_layers.conv.in_proj")
    with pytest.raises(ValueError, match="not valid.*conv.in_proj.*w1"):
        resolve_model_targets(model, ["in_proj_qkv"])
    apply_lora(model, targets=hf_names, rank=2, alpha=4, rngs=nnx.Rngs(0))
    assert set(lora_modules(model)) == set(every)
    out = save_peft_adapter(model, tmp_path / "adapter", str(d))
    names = set(SafetensorsFile(out / WEIGHTS_FILE).names())
    pre = "base_model.model.model.layers"
    assert {f"{pre}.2.self_attn.out_proj.lora_A.weight", f"{pre}.0.conv.in_proj.lora_B.weight",
            f"{pre}.5.conv.out_proj.lora_A.weight", f"{pre}.4.feed_forward.w1.lora_A.weight",
            f"{pre}.1.feed_forward.w2.lora_B.weight"} <= names
    assert not any(".2.conv." in n or ".0.self_attn." in n for n in names)
    assert len(names) == 2 * (2 * 4 + 4 * 2 + 6 * 3)  # attention x 2 layers, the conv x 4, the MLP x 6
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "self_attn.out_proj", "feed_forward.w1",
                                        "feed_forward.w3", "feed_forward.w2", "conv.in_proj", "conv.out_proj"]
    adapter = load_peft_adapter(out, rows=tuple(weight_rows(model.cfg)), model_cfg=model.cfg)
    assert set(adapter.weights) == set(every)
    assert adapter.weights["conv_layers.conv.in_proj"][0].shape == (4, 32, 2)
    assert adapter.weights["o_proj"][1].shape == (2, 2, 32)


def test_carried_conv_state_equals_the_uncached_forward():
    """The conv-only state cache (recurrent None) carried whole in the scan (`CarriedCacheScan`, serving's in-place
    path): a prefill of a right-padded batch, then two decode steps, give the uncached logits of each sequence."""
    model, seqs, logits, _, _ = _case("lfm2")
    prompts = [seqs[0][:3], seqs[1][:5]]  # the next two tokens of each come from the sequence itself

    @jax.jit
    def run(state, tokens, positions, segments, cache):
        m = nnx.merge(graphdef, state)
        out = m.hidden_states(tokens, positions, segments, cache=cache, runner=CarriedCacheScan())
        return m.logits(out.hidden), out.cache

    graphdef, state = nnx.split(model)
    tokens, segments = np.zeros((2, 5), np.int32), np.zeros((2, 5), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)], segments[b, :len(p)] = p, 1
    positions = np.tile(np.arange(5, dtype=np.int32), (2, 1))
    got, cache = run(state, tokens, positions, segments, empty_cache(model, 2, 8, jnp.float32))
    assert cache.state.recurrent is None and cache.state.conv.shape == (4, 2, 2, 32)
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(got)[b, :len(p)], logits[b][:len(p)], atol=TOL, rtol=0)
    for step in range(2):
        nxt = np.array([[seqs[b][len(p) + step]] for b, p in enumerate(prompts)], np.int32)
        got, cache = run(state, nxt, np.asarray(cache.lengths)[:, None], np.ones_like(nxt), cache)
        for b, p in enumerate(prompts):
            np.testing.assert_allclose(np.asarray(got)[b, 0], logits[b][len(p) + step], atol=TOL, rtol=0)


def test_qlora_nf4_quantises_both_stacks_and_every_adapter_trains():
    """QLoRA on LFM2: an NF4 base quantises every Linear site of both stacks (the conv's in_proj / out_proj too),
    the loss stays within NF4 rounding of the plain model's, and every adapter gets a gradient."""
    model = load_model(FIXTURES / "lfm2", dtype=jnp.float32, attention="xla")
    exp = np.load(FIXTURES / "lfm2" / "expected.npz")
    tokens = jnp.asarray(exp["tokens2"])[None]

    def loss(logits):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    # the plain model's loss from transformers' logits of the same tokens (= ours within 1e-4: test_a_sequence_alone;
    # a causal model's logits of tokens[:-1] are the first rows of those of tokens)
    plain = float(loss(jnp.asarray(exp["logits2"])[None, :-1]))
    quantize_model(model, "nf4")
    assert set(is_quantized(model).values()) == {"nf4"} and set(is_quantized(model)) == set(model_targets(model))
    apply_lora(model, targets="all-linear", rank=2, alpha=4, rngs=nnx.Rngs(0))
    graphdef, trainable, rest = nnx.split(model, TRAINABLE, ...)
    value, grads = jax.jit(jax.value_and_grad(lambda t: loss(nnx.merge(graphdef, t, rest)(tokens[:, :-1]))))(
        trainable)
    assert abs(float(value) - plain) < 0.05 * plain
    b_grads = [g for path, g in nnx.to_flat_state(grads) if path[-1] == "lora_b"]
    assert len(b_grads) == 12 and all(np.abs(np.asarray(g.get_value())).max() > 0 for g in b_grads)


def test_lfm2_moe_config_and_round_trip():
    """Lfm2MoeConfig's keys: every layer sparse (num_dense_layers 0), the sigmoid router with the expert bias,
    renormalised top-k (+ 1e-6) times routed_scaling_factor; the dense width kept as read; written back the same."""
    hf = _hf("lfm2_moe")
    cfg = ModelConfig.from_hf(hf)
    moe = cfg.moe
    assert cfg.model_type == "lfm2_moe" and cfg.short_conv.layers == (True, False, True, True, False)
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (6, 2, 16)
    assert (moe.router, moe.selection_bias, moe.norm_topk_prob, moe.norm_topk_eps) == ("sigmoid_topk", True, True, 1e-6)
    assert moe.routed_scaling_factor == 1.5 and cfg.intermediate_size == 48 and cfg.tie_word_embeddings
    out = cfg.to_hf()
    assert ModelConfig.from_hf(out) == cfg
    assert {k: out[k] for k in ("num_dense_layers", "use_expert_bias", "routed_scaling_factor", "num_experts",
                                "moe_intermediate_size", "intermediate_size")} == {
        "num_dense_layers": 0, "use_expert_bias": True, "routed_scaling_factor": 1.5, "num_experts": 6,
        "moe_intermediate_size": 16, "intermediate_size": 48}
    assert "block_auto_adjust_ff_dim" not in out and "full_attn_idxs" not in out
    assert ModelConfig.from_hf({k: v for k, v in hf.items() if k != "num_dense_layers"}).dense_layers == 2  # default
    with pytest.raises(ModelConfigError, match="num_dense_layers 6 must be in 0..num_hidden_layers"):
        ModelConfig.from_hf(hf | {"num_dense_layers": 6})


def test_lfm2_moe_dense_leading_layers():
    """num_dense_layers 3 over [conv, full, conv, conv, full, conv]: layers 0 - 2 dense in stacks of their own
    (`dense_conv_layers` rows 0, 2; `dense_layers` row 1), the rest sparse; each dense stack shares its kind's cache
    part, so the KV cache covers both attention layers in layer order and the conv state all four conv layers; the
    config round trip keeps the count; the router's other branches (no expert bias, no renormalisation)."""
    cfg = ModelConfig.from_hf(_hf("lfm2_moe_dense"))
    assert cfg.dense_layers == 3 and not cfg.moe.selection_bias and not cfg.moe.norm_topk_prob
    assert [stack_layers(cfg, s) for s in ("dense_conv_layers", "dense_layers", "conv_layers", "layers")] == [
        (0, 2), (1,), (3, 5), (4,)]
    pattern = layer_pattern(cfg)
    assert pattern.caches == ("conv_layers", "layers") and pattern.cache_rows("layers") == 2
    assert pattern.types[:2] == (LayerType("dense_conv_layers", cache="conv_layers"),
                                 LayerType("dense_layers", cache="layers"))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg and cfg.to_hf()["num_dense_layers"] == 3
    model, *_ = _case("lfm2_moe_dense")
    assert set(model.stacks) == {"layers", "conv_layers", "dense_layers", "dense_conv_layers"}
    trainable = load_model(FIXTURES / "lfm2_moe_dense", dtype=jnp.float32, attention="xla")
    assert make_router_trainable(trainable, jnp.float32) == 3 * 32 * 6  # the sparse layers' routers only
    assert empty_cache(model, 1, 4, jnp.float32).state.conv.shape[0] == 4
    published = ModelConfig.from_hf(_hf("lfm2_moe") | {"num_dense_layers": 1})  # LFM2-8B-A1B: only conv layers dense
    assert "dense_layers" not in {r.stack for r in weight_rows(published)}


def lora_b_grads(model, tokens) -> list[np.ndarray]:
    """The gradients of every LoRA B of `model` for the next-token loss on `tokens` (one sequence)."""
    tokens = jnp.asarray(tokens)[None]

    def loss(m):
        logits = m(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    graphdef, trainable, rest = nnx.split(model, TRAINABLE, ...)
    grads = jax.jit(jax.grad(lambda t: loss(nnx.merge(graphdef, t, rest))))(trainable)
    return [np.asarray(g.get_value()) for path, g in nnx.to_flat_state(grads) if path[-1] == "lora_b"]


def test_lfm2_moe_lora_targets_train_and_export(tmp_path):
    """LoRA on lfm2_moe: the attention (in `layers`), the experts' fused projections in both stacks and the short
    conv's, also asked for in LFM2's names; every adapter gets a gradient. Exported in PEFT's layout (its experts'
    `target_parameters` under `feed_forward.experts`, both stacks by HF layer) and read back the same (against
    PEFT's own adapter: tests/peft/test_moe_family_lora.py)."""
    model = load_model(FIXTURES / "lfm2_moe", dtype=jnp.float32, attention="xla")
    experts = ("experts.gate_up_proj", "experts.down_proj")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", *experts, *(f"conv_layers.{t}" for t in experts),
             "conv_layers.conv.in_proj", "conv_layers.conv.out_proj")
    assert model_targets(model) == every == resolve_model_targets(model, "all-linear")
    assert resolve_model_targets(model, ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "experts"]) == every
    with pytest.raises(ValueError, match="not valid on lfm2_moe"):
        resolve_model_targets(model, ["w1"])
    apply_lora(model, targets="all-linear", rank=2, alpha=4, rngs=nnx.Rngs(0))
    b_grads = lora_b_grads(model, np.load(FIXTURES / "lfm2_moe" / "expected.npz")["tokens2"])
    assert len(b_grads) == len(every) and all(np.abs(g).max() > 0 for g in b_grads)
    out = save_peft_adapter(model, tmp_path / "adapter", str(FIXTURES / "lfm2_moe"))
    written = json.loads((out / "adapter_config.json").read_text())["target_parameters"]
    assert written == ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
    back = load_peft_adapter(out, rows=tuple(weight_rows(model.cfg)), model_cfg=model.cfg).weights
    assert set(back) == set(every)
    for key, mod in lora_modules(model).items():
        np.testing.assert_array_equal(back[key][1], np.asarray(mod.lora_b.get_value()))


def test_lfm2_moe_dense_lora_targets():
    """With dense leading layers the dense MLP names target those layers (LFM2's w1 / w3 / w2 too), the experts
    the sparse ones."""
    model, *_ = _case("lfm2_moe_dense")
    mlp = ("gate_proj", "up_proj", "down_proj")
    got = set(resolve_model_targets(model, "all-linear"))
    assert {f"dense_conv_layers.{t}" for t in mlp} | {f"dense_layers.{t}" for t in mlp} <= got
    assert {"experts.gate_up_proj", "conv_layers.experts.down_proj", "dense_layers.q_proj",
            "dense_conv_layers.conv.in_proj"} <= got
    assert "gate_proj" not in got and "conv_layers.gate_proj" not in got
    assert set(resolve_model_targets(model, ["w1"])) == {"dense_layers.gate_proj", "dense_conv_layers.gate_proj"}
