"""Gemma 4's text model (gemma4_text, and the text backbone of gemma4) as llama.cpp's `gemma4` GGUF architecture:
the names, the rope factors and the metadata that llama.cpp's convert_hf_to_gguf (Gemma4Model, of the llama.cpp that
llama-cpp-python 0.3.36 vendors) writes, their inverses for reading, and what llama.cpp's gemma4 graph cannot run
(refused by name on write). A file reads back as gemma4_text (no vision / audio tower in it).

Names (HF, `model.language_model.` read as `model.`) -> GGUF: embed_tokens_per_layer per_layer_token_embd,
per_layer_model_projection per_layer_model_proj, per_layer_projection_norm per_layer_proj_norm, norm output_norm;
per layer `blk.N.`: input_layernorm attn_norm, post_attention_layernorm post_attention_norm, pre_feedforward_layernorm
ffn_norm, post_feedforward_layernorm post_ffw_norm, layer_scalar layer_output_scale.weight, per_layer_input_gate
inp_gate, per_layer_projection proj, post_per_layer_input_norm post_norm; the MoE block: router.proj ffn_gate_inp
(F32), router.scale ffn_gate_inp.scale, router.per_expert_scale ffn_down_exps.scale, experts.gate_up_proj
ffn_gate_up_exps (one tensor [E, 2F, D]), experts.down_proj ffn_down_exps, pre_feedforward_layernorm_2 pre_ffw_norm_2,
post_feedforward_layernorm_1 / _2 post_ffw_norm_1 / _2; the attention, q / k norms and GeGLU MLP under the shared
(llama) names (a full layer with attention_k_eq_v has no attn_v; a KV-shared layer no attn_k / attn_v / k norm).

Values: as they are (Gemma 4's RMSNorm multiplies by the weight; the embedding scales are llama.cpp's graph's own).
One tensor is added: rope_freqs.weight [head_dim_full / 2], the full layers' proportional rope as llama.cpp's
frequency factors: 1 on the int(head_dim_full * partial_rotary_factor / 2) rotated frequencies, 1e30 on the rest
(read back: partial_rotary_factor from the count of 1s).

Metadata (as the converter writes it): context_length, embedding_length, block_count, feed_forward_length (per layer,
2 x on the KV-shared layers, with use_double_wide_mlp; else one value), attention.head_count, head_count_kv (per layer
where the full layers' kv heads differ from the sliding layers'; else one value: the converter writes the list
whenever per_layer_config names them, equal or not), key_length / value_length (the full layers' head size),
key_length_swa / value_length_swa, layer_norm_rms_epsilon, rope.freq_base (full layers) / freq_base_swa,
rope.dimension_count (the full head size: the factors do the partial rotation) / dimension_count_swa,
attention.sliding_window and sliding_window_pattern (one bool per layer), attention.shared_kv_layers,
embedding_length_per_layer_input (0 without per-layer inputs), final_logit_softcapping (when set), expert_count /
expert_used_count / expert_feed_forward_length (the MoE block). No vocab_size (llama.cpp takes it from the tokens).

Refused on write, each by what llama.cpp would run differently: a hidden_activation other than gelu_pytorch_tanh
(llama.cpp's GELU is the tanh one), per-layer inputs with vocab_size_per_layer_input != vocab_size (llama.cpp
indexes both tables by the token), a full-layer rope other than proportional with factor 1 or a scaled sliding rope
(the converter writes neither), and KV-shared layers whose source is not llama.cpp's fixed choice (a shared sliding
layer reads layer first_shared - 2, a full one first_shared - 1: transformers reads the last earlier layer of its
kind, the same only when the last unshared layer is full and the one before it sliding).
"""
from __future__ import annotations

import numpy as np

from surojax.models.config import ModelConfig
from surojax.weights.gguf_reader import GGUFError
from surojax.weights.safetensors_file import WeightsError

ARCH = "gemma4"
MODEL_TYPE = "gemma4_text"
ROPE_FREQS = "rope_freqs.weight"
UNROTATED = 1e30  # the converter's factor on the frequencies the proportional rope leaves at zero

_L = "model.layers.{i}."
NAMES: dict[str, str] = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
    _L + "post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    _L + "pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    _L + "post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
    _L + "layer_scalar": "blk.{i}.layer_output_scale.weight",
    _L + "per_layer_input_gate.weight": "blk.{i}.inp_gate.weight",
    _L + "per_layer_projection.weight": "blk.{i}.proj.weight",
    _L + "post_per_layer_input_norm.weight": "blk.{i}.post_norm.weight",
    _L + "router.proj.weight": "blk.{i}.ffn_gate_inp.weight",
    _L + "router.scale": "blk.{i}.ffn_gate_inp.scale",
    _L + "router.per_expert_scale": "blk.{i}.ffn_down_exps.scale",
    _L + "experts.gate_up_proj": "blk.{i}.ffn_gate_up_exps.weight",
    _L + "experts.down_proj": "blk.{i}.ffn_down_exps.weight",
    _L + "pre_feedforward_layernorm_2.weight": "blk.{i}.pre_ffw_norm_2.weight",
    _L + "post_feedforward_layernorm_1.weight": "blk.{i}.post_ffw_norm_1.weight",
    _L + "post_feedforward_layernorm_2.weight": "blk.{i}.post_ffw_norm_2.weight",
}


def _llama_cpp_kv_source(cfg: ModelConfig, layer: int) -> int:
    first = cfg.num_layers - cfg.kv_shared_layers
    return first - (2 if cfg.layer_window(layer) is not None else 1)


def check_writable(cfg: ModelConfig) -> None:
    """WeightsError naming what llama.cpp's gemma4 graph would run differently (see the module docstring)."""
    if cfg.hidden_act != "gelu_pytorch_tanh":
        raise WeightsError(f"gemma4 hidden_activation {cfg.hidden_act!r} cannot be written to GGUF: llama.cpp's "
                           "gemma4 graph runs gelu_pytorch_tanh")
    if cfg.per_layer_input_size and cfg.per_layer_vocab_size != cfg.vocab_size:
        raise WeightsError(f"gemma4 vocab_size_per_layer_input {cfg.per_layer_vocab_size} cannot be written to GGUF: "
                           f"llama.cpp reads the per-layer input table by the token id, for all {cfg.vocab_size} "
                           "tokens (vocab_size)")
    rs = cfg.rope_scaling
    if rs.rope_type != "proportional" or rs.factor != 1.0:
        raise WeightsError(f"gemma4 full_attention rope {rs.rope_type!r} (factor {rs.factor:g}) cannot be written to "
                           "GGUF: the converter writes the full layers' rope as proportional, unscaled")
    if cfg.local_rope_scaling.rope_type != "default" or cfg.partial_rotary_factor != 1.0:
        raise WeightsError(f"gemma4 sliding_attention rope {cfg.local_rope_scaling.rope_type!r} cannot be written to "
                           "GGUF: llama.cpp runs the sliding layers' rope unscaled over the whole head")
    for i in range(cfg.num_layers - cfg.kv_shared_layers, cfg.num_layers):
        if cfg.kv_source(i) != _llama_cpp_kv_source(cfg, i):
            raise WeightsError(f"gemma4 num_kv_shared_layers {cfg.kv_shared_layers} with layer_types "
                               f"{[cfg.layer_kind(j) for j in range(cfg.num_layers)]} cannot be written to GGUF: "
                               f"KV-shared layer {i} reads layer {cfg.kv_source(i)}'s keys / values, llama.cpp's "
                               f"gemma4 graph would read layer {_llama_cpp_kv_source(cfg, i)}'s (it needs the last "
                               "unshared layer full and the one before it sliding)")


def rope_freqs(cfg: ModelConfig) -> np.ndarray:
    """The converter's rope_freqs.weight: 1 on the full layers' rotated frequencies, 1e30 on the others."""
    half = cfg.global_config().head_dim // 2
    rot = int(cfg.global_config().head_dim * cfg.rope_scaling.partial_rotary_factor / 2)
    return np.asarray([1.0] * rot + [UNROTATED] * (half - rot), np.float32)


def write_metadata(w, cfg: ModelConfig, gguf) -> None:
    """Every gemma4 key (see the module docstring); `w` a gguf.GGUFWriter."""
    g = cfg.global_config()
    L, first_shared = cfg.num_layers, cfg.num_layers - cfg.kv_shared_layers
    swa = [cfg.layer_window(i) is not None for i in range(L)]
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(L)
    if cfg.double_wide_mlp:
        w.add_feed_forward_length([cfg.intermediate_size * (1 if i < first_shared else 2) for i in range(L)])
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    if g.num_kv_heads != cfg.num_kv_heads:
        w.add_head_count_kv([cfg.num_kv_heads if s else g.num_kv_heads for s in swa])
    else:
        w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_freq_base_swa(cfg.local_rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.moe is not None:
        w.add_expert_count(cfg.moe.num_experts)
        w.add_expert_used_count(cfg.moe.experts_per_token)
        w.add_expert_feed_forward_length(cfg.moe.expert_intermediate_size)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_key_length_swa(cfg.head_dim)
    w.add_value_length_swa(cfg.head_dim)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window or 0)
    w.add_shared_kv_layers(cfg.kv_shared_layers)
    w.add_embedding_length_per_layer_input(cfg.per_layer_input_size)
    w.add_sliding_window_pattern(swa)
    w.add_rope_dimension_count(g.head_dim)
    w.add_rope_dimension_count_swa(cfg.head_dim)


def _per_layer(fields: dict, key: str, layers: int, source: str) -> list[int]:
    v = fields.get(key)
    if type(v) is int:
        v = [v] * layers
    if not (isinstance(v, list) and len(v) == layers and all(type(x) is int and x > 0 for x in v)):
        raise GGUFError(f"{source}: metadata key {key}: expected a positive integer or {layers} of them, found "
                        f"{v!r:.80}")
    return v


def hf_config(get, fields: dict, hf: dict, source: str) -> None:
    """Turn `hf` (the shared keys; num_key_value_heads, head_dim and intermediate_size not yet read) into Gemma 4's
    config.json from a gemma4 file's metadata; `get(key, kind, default)` reads `gemma4.<key>` type-checked. The
    tensors then decide attention_k_eq_v and the full layers' partial_rotary_factor (hf_from_tensors)."""
    L = hf["num_hidden_layers"]
    key = f"{ARCH}.attention.sliding_window_pattern"
    swa = fields.get(key)
    if not (isinstance(swa, list) and len(swa) == L and all(type(x) is bool for x in swa)):
        raise GGUFError(f"{source}: metadata key {key}: expected {L} booleans, found {swa!r:.80}")
    shared = get("attention.shared_kv_layers", default=0)
    if shared >= L:
        raise GGUFError(f"{source}: {ARCH}.attention.shared_kv_layers {shared}: expected fewer than the {L} layers")
    kv = _per_layer(fields, f"{ARCH}.attention.head_count_kv", L, source)
    ff = _per_layer(fields, f"{ARCH}.feed_forward_length", L, source)
    kv_swa, kv_full = {k for k, s in zip(kv, swa) if s}, {k for k, s in zip(kv, swa) if not s}
    wide = [f * (1 if i < L - shared else 2) for i, f in enumerate([ff[0]] * L)]
    if len(kv_swa) > 1 or len(kv_full) > 1 or (ff != [ff[0]] * L and ff != wide):
        raise GGUFError(f"{source}: {ARCH}.attention.head_count_kv {kv} / feed_forward_length {ff}: expected one kv "
                        "head count per layer type, and one width (doubled on the KV-shared layers)")
    head_full, head_swa = get("attention.key_length"), get("attention.key_length_swa")
    if (get("attention.value_length", default=head_full), get("attention.value_length_swa", default=head_swa)) != \
            (head_full, head_swa) or (get("rope.dimension_count", default=head_full),
                                      get("rope.dimension_count_swa", default=head_swa)) != (head_full, head_swa):
        raise GGUFError(f"{source}: {ARCH}.attention.value_length(_swa) and rope.dimension_count(_swa): expected "
                        f"the key lengths {head_full} / {head_swa} (llama.cpp's gemma4 rotates whole heads)")
    if "rope_scaling" in hf:
        raise GGUFError(f"{source}: {ARCH}.rope.scaling.type: llama.cpp's gemma4 applies no rope scaling")
    n_kv = kv_swa.pop() if kv_swa else kv_full.pop()
    full_kv = kv_full.pop() if kv_full else n_kv
    overrides = {k: v for k, v in (("head_dim", head_full), ("num_key_value_heads", full_kv))
                 if v != (head_swa if k == "head_dim" else n_kv)}
    theta = hf.pop("rope_theta")
    P = get("embedding_length_per_layer_input", default=0)
    hf.update(model_type=MODEL_TYPE, hidden_activation="gelu_pytorch_tanh", head_dim=head_swa,
              num_key_value_heads=n_kv, intermediate_size=ff[0], use_double_wide_mlp=ff == wide and ff != [ff[0]] * L,
              layer_types=["sliding_attention" if s else "full_attention" for s in swa],
              sliding_window=get("attention.sliding_window", default=0) or None,
              per_layer_config={str(i): overrides for i in range(L) if not swa[i]} if overrides else {},
              rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": theta},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": get("rope.freq_base_swa", float, theta)}},
              num_kv_shared_layers=shared, hidden_size_per_layer_input=P, vocab_size_per_layer_input=hf["vocab_size"],
              attention_k_eq_v=False, enable_moe_block=False)
    if f"{ARCH}.final_logit_softcapping" in fields:
        hf["final_logit_softcapping"] = get("final_logit_softcapping", float)
    experts = get("expert_count", default=0)
    if experts:
        hf.update(enable_moe_block=True, num_experts=experts, top_k_experts=get("expert_used_count"),
                  moe_intermediate_size=get("expert_feed_forward_length"))


def hf_from_tensors(hf: dict, names: set[str], factors: np.ndarray | None, source: str) -> None:
    """The config keys a gemma4 file holds in its tensors: attention_k_eq_v (an unshared full layer without attn_v)
    and the full layers' partial_rotary_factor (rope_freqs.weight's count of 1s)."""
    L, shared = hf["num_hidden_layers"], hf["num_kv_shared_layers"]
    full = [i for i, t in enumerate(hf["layer_types"]) if t == "full_attention"]
    unshared = [i for i in full if i < L - shared]
    hf["attention_k_eq_v"] = bool(unshared) and f"blk.{unshared[0]}.attn_v.weight" not in names
    head_full = hf["per_layer_config"].get(str(full[0]), {}).get("head_dim", hf["head_dim"]) if full else 0
    half = head_full // 2
    if factors is None:
        raise GGUFError(f"{source}: tensor {ROPE_FREQS} is missing (llama.cpp's gemma4 full layers need it)")
    rot = int(np.sum(factors == 1.0))
    if factors.shape != (half,) or not (np.all(factors[:rot] == 1.0) and np.all(factors[rot:] >= 1e29)):
        raise GGUFError(f"{source}: tensor {ROPE_FREQS}: expected {half} factors, 1 on the rotated frequencies then "
                        f"{UNROTATED:g} (a proportional rope), found shape {list(factors.shape)} values "
                        f"{factors.tolist()!r:.80}")
    hf["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 2 * rot / head_full
