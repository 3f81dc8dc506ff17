"""Families: Hugging Face `model_type` -> architecture flags + the weight-name table.

A family is data, not a copied model file: every dense family runs through `decoder.Decoder`; what differs is
in the flags of its `Family` entry and which rows of the shared weight table apply to it.

Weight table rows map a Hugging Face tensor name to a path in the NNX state of `Decoder`:
    hf name ("{i}" is the layer index)   ->  state path (dotted)   transform
Per-layer rows are stacked on the leading L axis. `transpose` turns HF's torch Linear layout [out, in] into
ours [in, out] (kernels are stored `x @ W`-ready; names below carry their axis order).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WeightRow:
    hf: str  # HF tensor name; "{i}" marks a per-layer tensor
    path: str  # dotted path in the Decoder's state
    transpose: bool = False
    when: str | None = None  # ModelConfig flag that must be true for this tensor to exist

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


# One table for all llama-style families. Axis orders: kernel_DN... are [in, out].
LLAMA_STYLE_WEIGHTS: tuple[WeightRow, ...] = (
    WeightRow("model.embed_tokens.weight", "embed.embedding"),  # [V, D]
    WeightRow("model.layers.{i}.input_layernorm.weight", "layers.attn_norm.scale"),  # [L, D]
    WeightRow("model.layers.{i}.self_attn.q_proj.weight", "layers.attn.q_proj.kernel", True),  # [L, D, N*H]
    WeightRow("model.layers.{i}.self_attn.k_proj.weight", "layers.attn.k_proj.kernel", True),  # [L, D, K*H]
    WeightRow("model.layers.{i}.self_attn.v_proj.weight", "layers.attn.v_proj.kernel", True),  # [L, D, K*H]
    WeightRow("model.layers.{i}.self_attn.o_proj.weight", "layers.attn.o_proj.kernel", True),  # [L, N*H, D]
    WeightRow("model.layers.{i}.self_attn.q_proj.bias", "layers.attn.q_proj.bias", when="attention_bias"),
    WeightRow("model.layers.{i}.self_attn.k_proj.bias", "layers.attn.k_proj.bias", when="attention_bias"),
    WeightRow("model.layers.{i}.self_attn.v_proj.bias", "layers.attn.v_proj.bias", when="attention_bias"),
    WeightRow("model.layers.{i}.self_attn.q_norm.weight", "layers.attn.q_norm.scale", when="qk_norm"),  # [L, H]
    WeightRow("model.layers.{i}.self_attn.k_norm.weight", "layers.attn.k_norm.scale", when="qk_norm"),  # [L, H]
    WeightRow("model.layers.{i}.post_attention_layernorm.weight", "layers.mlp_norm.scale"),  # [L, D]
    WeightRow("model.layers.{i}.mlp.gate_proj.weight", "layers.mlp.gate_proj.kernel", True),  # [L, D, F]
    WeightRow("model.layers.{i}.mlp.up_proj.weight", "layers.mlp.up_proj.kernel", True),  # [L, D, F]
    WeightRow("model.layers.{i}.mlp.down_proj.weight", "layers.mlp.down_proj.kernel", True),  # [L, F, D]
    WeightRow("model.norm.weight", "final_norm.scale"),  # [D]
    WeightRow("lm_head.weight", "lm_head.kernel", True, when="untied"),  # [D, V]
)

# HF module names users put in `lora_target_modules`, and where each lives in the Decoder.
LINEAR_MODULES: dict[str, str] = {
    "q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.o_proj",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # HF model_type
    hf_architecture: str  # `architectures[0]` written into config.json
    attention_bias: bool = False  # default when config.json does not say
    attention_bias_key: bool = True  # config.json has an `attention_bias` key
    qk_norm: bool = False
    sliding_window: bool = False  # honours config.json's `sliding_window`
    attention_sinks: bool = False  # a learned sink logit per query head (`self_attn.sinks`)
    o_proj_bias: bool = False  # `attention_bias` covers o_proj too
    tie_default: bool = False
    weights: tuple[WeightRow, ...] = LLAMA_STYLE_WEIGHTS


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family("qwen2", "Qwen2ForCausalLM", attention_bias=True, attention_bias_key=False),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
        Family("mistral", "MistralForCausalLM", attention_bias_key=False, sliding_window=True),
    )
}


class UnsupportedModelError(ValueError):
    is_user_error = True


def family_for(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def weight_rows(cfg) -> list[WeightRow]:
    """The table rows that exist for this config (bias / qk-norm / untied head filtered by its flags)."""
    flags = {"attention_bias": cfg.attention_bias, "qk_norm": cfg.qk_norm, "untied": not cfg.tie_word_embeddings}
    return [r for r in family_for(cfg.model_type).weights if r.when is None or flags[r.when]]
