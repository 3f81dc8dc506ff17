"""MoE shapes and FLOPs of surojax/bench: the active-parameter count behind MoE MFU, checked against the matmul
weights of a built model (not the formula again), and the Qwen3-30B-A3B shape against the HF MoE anchor's."""
from __future__ import annotations

import ast
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from surojax.bench.flops import adapter_params, linear_params, step_flops
from surojax.bench.shapes import SHAPES, model_config
from surojax.models.decoder import Decoder

ROOT = Path(__file__).resolve().parents[2]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def matmul_weights_per_token(model_cfg) -> int:
    """Matmul weights one token runs through, read from the shapes of a built (abstract) model: every 2-D+ kernel
    of the layers, the experts' kernels scaled by k / E (a token runs k of the E experts), plus the lm_head."""
    model = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    moe = model_cfg.moe
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model.layers, nnx.Param)):
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]  # e.g. mlp experts down_proj kernel
        if names[-1] != "kernel":
            continue  # norms, biases
        n = int(np.prod(leaf.shape))
        total += n * moe.experts_per_token // moe.num_experts if "experts" in names else n
    return total + model_cfg.hidden_size * model_cfg.vocab_size  # lm_head (untied here)


def test_moe_linear_params_count_the_router_and_k_experts_of_the_built_model():
    cfg = model_config("debug-moe")
    assert cfg.moe is not None and not cfg.tie_word_embeddings
    assert linear_params(cfg) == matmul_weights_per_token(cfg)
    # the same, as the model config counts it: active parameters minus the embedding lookup and the norms
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    assert linear_params(cfg) == cfg.num_active_params() - cfg.vocab_size * cfg.hidden_size - norms


def test_qwen3_30b_a3b_flops_per_token():
    cfg = model_config("qwen3-30b-a3b")
    assert linear_params(cfg) / 1e9 == pytest.approx(3.04, abs=0.01)  # of 30.5B parameters
    fl = step_flops(cfg, mode="lora", tokens=2048, segment_lengths=[2048], targets=ATTENTION)
    assert fl["per_token"] / 1e9 == pytest.approx(14.66, abs=0.01)
    full = step_flops(cfg, mode="full", tokens=2048, segment_lengths=[2048])  # the "6 x active params" count
    assert full["linear"] == 6 * linear_params(cfg) * 2048 and full["attention"] == fl["attention"]


def test_expert_lora_adapters_count_k_experts_per_token():
    cfg = model_config("debug-moe")
    D, F, k, L, r = cfg.hidden_size, cfg.moe.expert_intermediate_size, cfg.moe.experts_per_token, cfg.num_layers, 4
    attn = adapter_params(cfg, r, ATTENTION)
    assert attn == L * r * ((D + cfg.q_dim) + 2 * (D + cfg.kv_dim) + (cfg.q_dim + D))
    both = adapter_params(cfg, r, ATTENTION + ("gate_up_proj", "down_proj"))
    assert both - attn == L * r * k * ((D + 2 * F) + (F + D))
    with pytest.raises(ValueError, match="gate_proj"):
        adapter_params(cfg, r, ("gate_proj",))  # a MoE layer has no dense MLP


def test_qwen3_30b_a3b_is_the_hf_moe_anchors_shape():
    """benchmarks/anchors/hf_moe_baseline.py (a copy of shared/bench/hf_moe_baseline.py, which the GPU machine does
    not have) builds its config with AutoConfig.for_model("qwen3_moe", ...): every key must be our shape's."""
    tree = ast.parse((ROOT / "benchmarks/anchors/hf_moe_baseline.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "for_model")
    anchor = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    anchor["model_type"] = ast.literal_eval(call.args[0])
    assert anchor.pop("output_router_logits") is False  # no aux loss in the anchor's step: not a shape
    assert anchor == SHAPES["qwen3-30b-a3b"]
