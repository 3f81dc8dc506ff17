"""LFM2 (lfm2) as llama.cpp's `lfm2` GGUF architecture: the names, the conv reshape and the metadata that llama.cpp's
convert_hf_to_gguf (LFM2Model, of the llama.cpp that llama-cpp-python 0.3.36 vendors) writes, their inverses for
reading, and what llama.cpp's lfm2 graph cannot run (refused by name on write).

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
"""
from __future__ import annotations

import numpy as np

from surojax.models.config import ModelConfig
from surojax.weights.gguf_reader import GGUFError
from surojax.weights.safetensors_file import WeightsError

ARCH = "lfm2"
MODEL_TYPE = "lfm2"

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
_CONV = "conv.conv.weight"


def check_writable(cfg: ModelConfig) -> None:
    if cfg.short_conv.bias:
        raise WeightsError("lfm2 with conv_bias true cannot be written to GGUF: llama.cpp's lfm2 graph has no "
                           "short-convolution biases (conv.in_proj / conv.conv / conv.out_proj .bias)")
    if cfg.rope_scaling.rope_type != "default":
        raise WeightsError(f"lfm2 rope scaling {cfg.rope_scaling.rope_type!r} cannot be written to GGUF (llama.cpp's "
                           "converter writes none for this architecture)")


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
    w.add_shortconv_l_cache(cfg.short_conv.kernel)


def hf_config(get, fields: dict, hf: dict, source: str) -> None:
    """Turn `hf` (the shared keys; num_key_value_heads not yet read) into LFM2's config.json from an lfm2 file's
    metadata: the layer kinds from the per-layer head_count_kv (0: a conv layer)."""
    layers = hf["num_hidden_layers"]
    key = f"{ARCH}.attention.head_count_kv"
    kv = fields.get(key)
    if type(kv) is int:
        kv = [kv] * layers
    if not (isinstance(kv, list) and len(kv) == layers and all(type(x) is int and x >= 0 for x in kv)
            and len({x for x in kv if x}) <= 1):
        raise GGUFError(f"{source}: metadata key {key}: expected {layers} head counts (0 on a conv layer, one "
                        f"count on the attention layers), found {kv!r:.80}")
    if "rope_scaling" in hf:
        raise GGUFError(f"{source}: {ARCH}.rope.scaling.type: llama.cpp's lfm2 applies no rope scaling")
    hf.update(model_type=MODEL_TYPE, num_key_value_heads=max(kv) or hf["num_attention_heads"],
              layer_types=["full_attention" if x else "conv" for x in kv],
              conv_L_cache=get("shortconv.l_cache"), conv_bias=False, block_auto_adjust_ff_dim=False,
              norm_eps=hf.pop("rms_norm_eps"))
    hf.pop("head_dim")
