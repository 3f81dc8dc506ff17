"""LFM2 (lfm2) as llama.cpp's `lfm2` GGUF architecture and LFM2-MoE (lfm2_moe) as `lfm2moe`: the names, the conv
reshape and the metadata that llama.cpp's convert_hf_to_gguf (LFM2Model / LFM2MoeModel, of the llama.cpp that
llama-cpp-python 0.3.36 vendors) writes, their inverses for reading, and what llama.cpp's lfm2 / lfm2moe graphs
cannot run (refused by name on write).

Names (HF -> GGUF, per layer `blk.N.`): operator_norm attn_norm, ffn_norm ffn_norm, feed_forward.w1 / w3 / w2
ffn_gate / ffn_up / ffn_down; attention layers: self_attn.q_proj / k_proj / v_proj attn_q / attn_k / attn_v,
self_attn.out_proj attn_output, q_layernorm / k_layernorm attn_q_norm / attn_k_norm; short-convolution layers:
conv.in_proj shortconv.in_proj, conv.conv shortconv.conv, conv.out_proj shortconv.out_proj; model.embedding_norm
token_embd_norm (the final norm, llama.cpp's LFM2 name); the head tied unless untied (output).

Values: the norms as they are (LFM2's RMSNorm multiplies by the weight); the depthwise conv [D, 1, K] as [D, K]
(GGUF ne [K, D]), always F32 as the converter writes it.

Metadata (as the converter writes it): vocab_size, context_length, embedding_length, block_count,
feed_forward_length (the SwiGLU's width after LFM2's block_auto_adjust_ff_dim rule: our intermediate_size),
attention.head_count, attention.head_count_kv per layer (0 on a conv layer: how llama.cpp tells the layer kinds),
attention.layer_norm_rms_epsilon (norm_eps), rope.freq_base, shortconv.l_cache (conv_L_cache). Refused on write:
conv_bias (llama.cpp's lfm2 has no conv / projection biases) and rope scaling (the converter writes none that its
lfm2 graph applies).

LFM2-MoE (`lfm2moe`): the same names, plus per sparse layer the router feed_forward.gate ffn_gate_inp (F32),
feed_forward.expert_bias exp_probs_b.bias (F32) and the experts (transformers 5's fused gate_up_proj / down_proj as
the converter's merged w1 / w3 / w2: ffn_gate_exps | ffn_up_exps, ffn_down_exps); the dense leading layers keep
ffn_gate / ffn_up / ffn_down. Metadata: vocab_size, context_length, embedding_length, block_count,
feed_forward_length (intermediate_size as is: the dense layers' width), attention.head_count / head_count_kv (per
layer, 0 on a conv layer) / layer_norm_rms_epsilon, rope.freq_base, expert_count, expert_used_count,
expert_feed_forward_length, leading_dense_block_count (num_dense_layers), expert_gating_func (2: sigmoid),
shortconv.l_cache. llama.cpp's lfm2moe graph renormalises the top-k sigmoid scores, never scales them and needs the
selection bias: norm_topk_prob false (refused for every MoE), routed_scaling_factor other than 1 and
use_expert_bias false (the converter writes no exp_probs_b, which llama.cpp requires) are refused on write; a file
whose gating function is not sigmoid is refused on read.
"""
from __future__ import annotations

import numpy as np

from surojax.models.config import ModelConfig
from surojax.weights.gguf_reader import GGUFError
from surojax.weights.safetensors_file import WeightsError

ARCH = "lfm2"
MODEL_TYPE = "lfm2"
MOE_ARCH = "lfm2moe"
MOE_MODEL_TYPE = "lfm2_moe"
ARCHS = (ARCH, MOE_ARCH)
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (gguf.ExpertGatingFuncType.SIGMOID)

_L = "model.layers.{i}."
NAMES: dict[str, str] = {
    _L + "operator_norm.weight": "blk.{i}.attn_norm.weight",
    _L + "ffn_norm.weight": "blk.{i}.ffn_norm.weight",
    _L + "feed_forward.w1.weight": "blk.{i}.ffn_gate.weight",
    _L + "feed_forward.w3.weight": "blk.{i}.ffn_up.weight",
    _L + "feed_forward.w2.weight": "blk.{i}.ffn_down.weight",
    _L + "self_attn.out_proj.weight": "blk.{i}.attn_output.weight",
    _L + "self_attn.q_layernorm.weight": "blk.{i}.attn_q_norm.weight",
    _L + "self_attn.k_layernorm.weight": "blk.{i}.attn_k_norm.weight",
    _L + "conv.in_proj.weight": "blk.{i}.shortconv.in_proj.weight",
    _L + "conv.out_proj.weight": "blk.{i}.shortconv.out_proj.weight",
    _L + "conv.conv.weight": "blk.{i}.shortconv.conv.weight",
    "model.embedding_norm.weight": "token_embd_norm.weight",
}
MOE_NAMES: dict[str, str] = {
    **NAMES,
    _L + "feed_forward.gate.weight": "blk.{i}.ffn_gate_inp.weight",
    _L + "feed_forward.expert_bias": "blk.{i}.exp_probs_b.bias",
    _L + "feed_forward.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
}
# the fused experts' gate_up_proj [E, 2F, D] = [ffn_gate_exps | ffn_up_exps] (gguf_checkpoint.GGUF_PARTS)
MOE_PARTS: dict[str, tuple[str, ...]] = {
    _L + "feed_forward.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
}
_CONV = "conv.conv.weight"


def check_writable(cfg: ModelConfig) -> None:
    if cfg.short_conv.bias:
        raise WeightsError(f"{cfg.model_type} with conv_bias true cannot be written to GGUF: llama.cpp's graph has "
                           "no short-convolution biases (conv.in_proj / conv.conv / conv.out_proj .bias)")
    moe = cfg.moe
    if moe is not None and moe.routed_scaling_factor != 1.0:
        raise WeightsError(f"lfm2_moe routed_scaling_factor {moe.routed_scaling_factor:g} cannot be written to GGUF: "
                           "llama.cpp's lfm2moe graph does not scale the routing weights (it reads no scale)")
    if moe is not None and not moe.selection_bias:
        raise WeightsError("lfm2_moe with use_expert_bias false cannot be written to GGUF: llama.cpp's lfm2moe graph "
                           "requires each sparse layer's expert bias (blk.N.exp_probs_b.bias), which such a model "
                           "does not have")
    if cfg.rope_scaling.rope_type != "default":
        raise WeightsError(f"{cfg.model_type} rope scaling {cfg.rope_scaling.rope_type!r} cannot be written to GGUF "
                           "(llama.cpp's converter writes none for this architecture)")


def to_file(cfg: ModelConfig, hf_name: str, w: np.ndarray) -> np.ndarray:
    if hf_name.endswith(_CONV):
        w = w.reshape(w.shape[0], w.shape[-1])
    return np.ascontiguousarray(w, np.float32)


def from_file(cfg: ModelConfig, hf_name: str, a: np.ndarray, gguf_name: str, source: str) -> np.ndarray:
    return a.reshape(a.shape[0], 1, a.shape[1]) if hf_name.endswith(_CONV) else a


def file_shape(hf_name: str, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (hf_shape[0], hf_shape[-1]) if hf_name.endswith(_CONV) else tuple(hf_shape)


def forced_f32(gguf_name: str) -> bool:
    return gguf_name.endswith("shortconv.conv.weight")


def write_metadata(w, cfg: ModelConfig, gguf) -> None:
    """Every lfm2 key (see the module docstring); `w` a gguf.GGUFWriter."""
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv([0 if conv else cfg.num_kv_heads for conv in cfg.short_conv.layers])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.moe is not None:
        w.add_expert_count(cfg.moe.num_experts)
        w.add_expert_used_count(cfg.moe.experts_per_token)
        w.add_expert_feed_forward_length(cfg.moe.expert_intermediate_size)
        w.add_leading_dense_block_count(cfg.dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_shortconv_l_cache(cfg.short_conv.kernel)


def hf_config(get, fields: dict, hf: dict, source: str) -> None:
    """Turn `hf` (the shared keys; num_key_value_heads not yet read) into LFM2's (LFM2-MoE's) config.json from an
    lfm2 (lfm2moe) file's metadata: the layer kinds from the per-layer head_count_kv (0: a conv layer)."""
    layers = hf["num_hidden_layers"]
    moe = hf["model_type"] == MOE_MODEL_TYPE
    arch = MOE_ARCH if moe else ARCH
    key = f"{arch}.attention.head_count_kv"
    kv = fields.get(key)
    if type(kv) is int:
        kv = [kv] * layers
    if not (isinstance(kv, list) and len(kv) == layers and all(type(x) is int and x >= 0 for x in kv)
            and len({x for x in kv if x}) <= 1):
        raise GGUFError(f"{source}: metadata key {key}: expected {layers} head counts (0 on a conv layer, one "
                        f"count on the attention layers), found {kv!r:.80}")
    if "rope_scaling" in hf:
        raise GGUFError(f"{source}: {arch}.rope.scaling.type: llama.cpp's {arch} applies no rope scaling")
    hf.update(num_key_value_heads=max(kv) or hf["num_attention_heads"],
              layer_types=["full_attention" if x else "conv" for x in kv],
              conv_L_cache=get("shortconv.l_cache"), conv_bias=False, norm_eps=hf.pop("rms_norm_eps"))
    hf.pop("head_dim")
    if not moe:
        hf["block_auto_adjust_ff_dim"] = False
        return
    gating = get("expert_gating_func", default=SIGMOID_GATING)
    if gating != SIGMOID_GATING:
        raise GGUFError(f"{source}: {arch}.expert_gating_func: expected {SIGMOID_GATING} (sigmoid: LFM2-MoE's router), "
                        f"found {gating}")
    dense = get("leading_dense_block_count", default=0)
    if dense > layers:
        raise GGUFError(f"{source}: {arch}.leading_dense_block_count {dense}: expected at most the {layers} layers")
    # llama.cpp's graph: sigmoid scores chosen with exp_probs_b, renormalised, unscaled
    hf.update(num_dense_layers=dense, moe_intermediate_size=get("expert_feed_forward_length"),
              norm_topk_prob=True, use_expert_bias=True, routed_scaling_factor=1.0)
