"""Gemma 3's text model (gemma3_text, and the text backbone of gemma3) as llama.cpp's `gemma3` GGUF architecture:
the names, the norm shift and the metadata that llama.cpp's convert_hf_to_gguf (Gemma3Model, of the llama.cpp that
llama-cpp-python 0.3.36 vendors) writes, their inverses for reading, and what llama.cpp's gemma3 graph cannot run
(refused by name on write). A file reads back as gemma3_text (no vision tower in it).

Names (HF, `model.language_model.` read as `model.`) -> GGUF, per layer `blk.N.`: input_layernorm attn_norm,
post_attention_layernorm post_attention_norm, pre_feedforward_layernorm ffn_norm, post_feedforward_layernorm
post_ffw_norm; the attention, its q / k norms and the GeGLU MLP under the shared (llama) names; model.norm
output_norm; the head tied (no output.weight) unless untied.

Values: every RMSNorm weight (the four sandwich norms, q_norm / k_norm, the final norm) is written as 1 + w (Gemma 3
multiplies by 1 + w, llama.cpp by the weight; in float32 (w + 1) - 1 + 1 == w + 1, so a round trip keeps the
logits). The embedding scale sqrt(hidden_size) is llama.cpp's graph's own: nothing is written for it.

Metadata (as the converter writes it): context_length, embedding_length, block_count, feed_forward_length,
attention.head_count / head_count_kv / key_length / value_length / layer_norm_rms_epsilon, rope.freq_base (the
full-attention layers' theta), rope.freq_base_swa (the sliding layers'), rope.scaling.type / factor (the full layers'
linear scaling), attention.sliding_window. No rope.dimension_count, no vocab_size (llama.cpp takes it from the
tokens). llama.cpp's reading decides what can be written:
  - the sliding layers are llama.cpp's default pattern (every 6th layer global) unless the file says otherwise: a
    model whose layer_types differ gets attention.sliding_window_pattern (one bool per layer, which llama.cpp reads;
    the converter does not write it, so its file of such a model runs with the wrong layers windowed);
  - llama.cpp's attention scale is 1 / sqrt(key_length) (1 / sqrt(hidden / heads) for the 62-layer 27B): a
    query_pre_attn_scalar other than that is refused, as are rope scaling on the sliding layers (llama.cpp keeps
    them unscaled) and a full-attention rope scaling other than linear.
"""
from __future__ import annotations

import numpy as np

from surojax.models.config import ModelConfig
from surojax.weights.gguf_reader import GGUFError
from surojax.weights.safetensors_file import WeightsError

ARCH = "gemma3"
MODEL_TYPE = "gemma3_text"
LLAMA_CPP_PERIOD = 6  # llama.cpp's gemma3 default: layer i slides unless i % 6 == 5

_L = "model.layers.{i}."
NAMES: dict[str, str] = {
    _L + "post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    _L + "pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    _L + "post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
}


def _default_pattern(n_layers: int) -> list[bool]:
    return [i % LLAMA_CPP_PERIOD < LLAMA_CPP_PERIOD - 1 for i in range(n_layers)]


def llama_cpp_query_scalar(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float:
    """The query_pre_attn_scalar llama.cpp's gemma3 graph uses (it reads none from the file)."""
    return float(hidden // n_heads) if n_layers == 62 else float(head_dim)


def check_writable(cfg: ModelConfig) -> None:
    """WeightsError naming what llama.cpp's gemma3 graph would run differently."""
    want = llama_cpp_query_scalar(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    if cfg.query_pre_attn_scalar != want:
        raise WeightsError(f"gemma3 query_pre_attn_scalar {cfg.query_pre_attn_scalar:g} cannot be written to GGUF: "
                           f"llama.cpp's gemma3 graph scales queries by 1/sqrt({want:g}) and reads no scale from the "
                           "file")
    if cfg.local_rope_scaling.rope_type != "default":
        raise WeightsError(f"gemma3 sliding_attention rope scaling {cfg.local_rope_scaling.rope_type!r} cannot be "
                           "written to GGUF: llama.cpp runs the sliding layers' rope unscaled")
    if cfg.rope_scaling.rope_type not in ("default", "linear"):
        raise WeightsError(f"gemma3 full_attention rope scaling {cfg.rope_scaling.rope_type!r} cannot be written "
                           "to GGUF (the converter writes linear scaling for this architecture)")


def to_file(cfg: ModelConfig, hf_name: str, w: np.ndarray) -> np.ndarray:
    """An HF tensor (float32, HF layout) -> the file's values: the (1 + w) norms shifted."""
    return np.ascontiguousarray(w + np.float32(1) if hf_name.endswith("norm.weight") else w, np.float32)


def from_file(cfg: ModelConfig, hf_name: str, a: np.ndarray, gguf_name: str, source: str) -> np.ndarray:
    return a - np.float32(1) if hf_name.endswith("norm.weight") else a


def file_shape(hf_name: str, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(hf_shape)


def forced_f32(gguf_name: str) -> bool:
    return False


def write_metadata(w, cfg: ModelConfig, gguf) -> None:
    """Every gemma3 key (see the module docstring); `w` a gguf.GGUFWriter."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_freq_base_swa(cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta)
    if cfg.rope_scaling.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    pattern = [cfg.layer_window(i) is not None for i in range(cfg.num_layers)]
    if any(pattern):
        w.add_sliding_window(cfg.sliding_window)
        if pattern != _default_pattern(cfg.num_layers):
            w.add_sliding_window_pattern(pattern)


def hf_config(get, fields: dict, hf: dict, source: str) -> None:
    """Turn `hf` (the shared keys) into Gemma 3's config.json from a gemma3 file's metadata; `get(key, kind,
    default)` reads `gemma3.<key>` type-checked."""
    layers = hf["num_hidden_layers"]
    window = get("attention.sliding_window", default=0)
    key = f"{ARCH}.attention.sliding_window_pattern"
    pattern = fields.get(key)
    if pattern is None:
        period = get("attention.sliding_window_pattern", default=LLAMA_CPP_PERIOD)
        pattern = [i % period < period - 1 for i in range(layers)] if period else [True] * layers  # 0: all
    elif not (isinstance(pattern, list) and len(pattern) >= layers and all(type(x) is bool for x in pattern)):
        raise GGUFError(f"{source}: metadata key {key}: expected {layers} booleans, found {pattern!r:.80}")
    if not window:
        pattern = [False] * layers
    full = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
    if "rope_scaling" in hf:
        full.update(hf.pop("rope_scaling"))
    local = {"rope_type": "default", "rope_theta": get("rope.freq_base_swa", float, 10000.0)}
    if f"{ARCH}.final_logit_softcapping" in fields:  # the config refuses it by name
        hf["final_logit_softcapping"] = get("final_logit_softcapping", float)
    hf.update(model_type=MODEL_TYPE, hidden_activation="gelu_pytorch_tanh",
              layer_types=["sliding_attention" if p else "full_attention" for p in pattern[:layers]],
              sliding_window=window or None, rope_parameters={"full_attention": full, "sliding_attention": local},
              query_pre_attn_scalar=llama_cpp_query_scalar(layers, hf["hidden_size"], hf["num_attention_heads"],
                                                           hf["head_dim"]))
