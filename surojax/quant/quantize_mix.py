"""llama.cpp's file types (`llama-quantize ... Q4_K_M`): which GGUF type each tensor of a dense model gets.

A file type names a default tensor type and a rule that gives some tensors more bits. This module follows
`llama_tensor_get_type_impl` + `tensor_type_fallback` (llama.cpp src/llama-quant.cpp, no importance matrix, no
manual overrides) for the dense llama / qwen2 / qwen3 tensors surojax writes:

    use_more_bits(i, n) = i < n/8  or  i >= 7n/8  or  (i - n/8) % 3 == 2        (integer division)

    output.weight (and token_embd.weight when the head is tied): Q6_K, unless the file type is Q8_0 (stays Q8_0)
        or the row length K is not a multiple of the default type's block (then Q8_0)
    attn_v     Q2_K: Q4_K if n_head / n_head_kv >= 4 else Q3_K;  Q3_K_M: Q5_K on layers 0-1, else Q4_K;
               Q4_K_M / Q5_K_M: Q6_K where use_more_bits(layer);  70B-class (80 layers, llama / qwen2): Q3_K or
               Q4_K become Q5_K
    ffn_down   Q2_K: Q3_K;  Q3_K_M: Q5_K on layers < n/16, else Q4_K;  Q4_K_M / Q5_K_M: Q6_K where use_more_bits
    attn_output  Q2_K: Q3_K;  Q3_K_M: Q4_K
    IQ4_NL / IQ4_XS: attn_v Q5_K if n_head / n_head_kv >= 4; ffn_down Q5_K on layers < n/8
    everything else (attn_q, attn_k, ffn_gate, ffn_up, token_embd): the default type
    1-D tensors (norms, biases, rope_freqs): F32, never quantised

Fallback when a row length K is not a multiple of the chosen type's block (256 for the K-quants):
Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; still not a multiple of 32 ->
F16.
F32 / F16 / BF16 file types store every 2-D weight in that type.

Training over a mix (`qlora_gguf: q4_k_m`): the decoder scans over stacked layers, so one target (say v_proj) must
have one format on every layer. `uniform_target_types` gives each target the widest type the rule picks for any
of its layers (Q4_K_M: v_proj and down_proj in Q6_K on every layer, the rest Q4_K; applied to a model by
surojax.quant.model.quantize_model_mix) and the file's own per-layer choice is used when writing a .gguf.
"""
from __future__ import annotations

import gguf

# file type name -> (llama_ftype, default tensor type)
FILE_TYPES: dict[str, tuple[int, str]] = {
    "f32": (gguf.LlamaFileType.ALL_F32, "f32"),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, "f16"),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, "bf16"),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, "q8_0"),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, "q4_0"),
    "q4_1": (gguf.LlamaFileType.MOSTLY_Q4_1, "q4_1"),
    "q5_0": (gguf.LlamaFileType.MOSTLY_Q5_0, "q5_0"),
    "q5_1": (gguf.LlamaFileType.MOSTLY_Q5_1, "q5_1"),
    "q2_k": (gguf.LlamaFileType.MOSTLY_Q2_K, "q2_k"),
    "q3_k_m": (gguf.LlamaFileType.MOSTLY_Q3_K_M, "q3_k"),
    "q4_k_m": (gguf.LlamaFileType.MOSTLY_Q4_K_M, "q4_k"),
    "q5_k_m": (gguf.LlamaFileType.MOSTLY_Q5_K_M, "q5_k"),
    "q6_k": (gguf.LlamaFileType.MOSTLY_Q6_K, "q6_k"),
    "iq4_nl": (gguf.LlamaFileType.MOSTLY_IQ4_NL, "iq4_nl"),
    "iq4_xs": (gguf.LlamaFileType.MOSTLY_IQ4_XS, "iq4_xs"),
}
FLOAT_TYPES = ("f32", "f16", "bf16")
_BLOCK = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q2_k": 256, "q3_k": 256, "q4_k": 256,
          "q5_k": 256, "q6_k": 256, "iq4_nl": 32, "iq4_xs": 256, "f32": 1, "f16": 1, "bf16": 1}
_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "iq4_xs": "iq4_nl"}
# bits per weight, to order types by width
_BITS = {"q2_k": 2.625, "q3_k": 3.4375, "q4_0": 4.5, "q4_1": 5.0, "q4_k": 4.5, "q5_0": 5.5, "q5_1": 6.0,
         "q5_k": 5.5, "q6_k": 6.5625, "q8_0": 8.5, "iq4_nl": 4.5, "iq4_xs": 4.25, "bf16": 16, "f16": 16, "f32": 32}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fallback(t: str, ncols: int) -> str:
    if ncols % _BLOCK[t] == 0:
        return t
    t = _FALLBACK.get(t, t)
    return t if ncols % _BLOCK[t] == 0 else "f16"


def tensor_type(file_type: str, name: str, ncols: int, *, n_layers: int, n_gqa: int = 1, tied: bool = False,
                arch: str = "llama") -> str:
    """The GGUF type of the 2-D tensor `name` (llama.cpp name, e.g. "blk.3.attn_v.weight") of row length `ncols`
    in a file of `file_type` (a key of FILE_TYPES)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown GGUF file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
    ft, t = file_type, FILE_TYPES[file_type][1]
    if t in FLOAT_TYPES:
        return t
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    is_70b = n_layers == 80 and arch in ("llama", "qwen2")
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if ncols % _BLOCK[t]:
            t = "q8_0"
        elif t != "q8_0":
            t = "q6_k"
    elif "attn_v.weight" in name:
        if ft == "q2_k":
            t = "q4_k" if n_gqa >= 4 else "q3_k"
        elif ft == "q3_k_m":
            t = "q5_k" if layer < 2 else "q4_k"
        elif ft in ("iq4_nl", "iq4_xs") and n_gqa >= 4:
            t = "q5_k"
        elif ft in ("q4_k_m", "q5_k_m") and use_more_bits(layer, n_layers):
            t = "q6_k"
        if is_70b and t in ("q3_k", "q4_k"):
            t = "q5_k"
    elif "ffn_down" in name:
        if ft == "q2_k":
            t = "q3_k"
        elif ft == "q3_k_m":
            t = "q5_k" if layer < n_layers // 16 else "q4_k"
        elif ft in ("q4_k_m", "q5_k_m") and use_more_bits(layer, n_layers):
            t = "q6_k"
        elif ft in ("iq4_nl", "iq4_xs") and layer < n_layers // 8:
            t = "q5_k"
    elif "attn_output.weight" in name:
        if ft == "q2_k":
            t = "q3_k"
        elif ft == "q3_k_m":
            t = "q4_k"
    return _fallback(t, ncols)


# our LoRA target names -> the llama.cpp tensor of each layer
TARGET_TENSORS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                  "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def widest(types) -> str:
    return max(types, key=lambda t: _BITS[t])


def uniform_target_types(file_type: str, cfg, targets) -> dict[str, str]:
    """For training over a file type: target name -> one format for all its layers (the widest the rule picks)."""
    n_gqa = cfg.num_heads // cfg.num_kv_heads
    ncols = {"q_proj": cfg.hidden_size, "k_proj": cfg.hidden_size, "v_proj": cfg.hidden_size,
             "o_proj": cfg.q_dim, "gate_proj": cfg.hidden_size, "up_proj": cfg.hidden_size,
             "down_proj": cfg.intermediate_size}
    out = {}
    for t in targets:
        per_layer = [tensor_type(file_type, f"blk.{i}.{TARGET_TENSORS[t]}.weight", ncols[t], n_layers=cfg.num_layers,
                                 n_gqa=n_gqa, arch=cfg.model_type) for i in range(cfg.num_layers)]
        out[t] = widest(per_layer)
    return out
