"""Qwen3.5's hybrid as llama.cpp's GGUF architectures: the dense qwen3_5_text / qwen3_5 as `qwen35`, the MoE
qwen3_5_moe_text / qwen3_5_moe as `qwen35moe`: the tensor names, the per-tensor transforms and the metadata that
llama.cpp's convert_hf_to_gguf (Qwen3_5TextModel / Qwen3_5MoeTextModel, of the llama.cpp that llama-cpp-python
0.3.36 vendors) writes, and their inverses for reading. surojax.weights.gguf_checkpoint calls these for both
architectures; everything else there is shared with the other families (the MoE's router, stacked experts and
shared expert are the shared MoE rows: ffn_gate_inp, ffn_gate_exps / ffn_up_exps / ffn_down_exps, ffn_gate_shexp /
ffn_up_shexp / ffn_down_shexp, ffn_gate_inp_shexp). The two converter classes differ only in their MLP; the
DeltaNet / attention tensors and keys below are the same for both.

Names (HF, `model.language_model.` read as `model.`) -> GGUF, per layer `blk.N.`:
    input_layernorm attn_norm, post_attention_layernorm post_attention_norm (not ffn_norm), mlp.* ffn_gate / ffn_up /
    ffn_down; attention layers: self_attn.q_proj attn_q (its rows per head query | output gate, as HF stores
    them: llama.cpp splits them per head), k_proj attn_k, v_proj attn_v, o_proj attn_output, q_norm / k_norm
    attn_q_norm / attn_k_norm; Gated DeltaNet layers (linear_attn.*): in_proj_qkv attn_qkv, in_proj_z attn_gate,
    in_proj_b ssm_beta, in_proj_a ssm_alpha, conv1d ssm_conv1d, dt_bias ssm_dt.bias, A_log ssm_a (no suffix),
    norm ssm_norm, out_proj ssm_out.

Values (file <- HF; reading applies the inverse):
    every RMSNorm weight but the DeltaNet's gated norm:  w + 1   (llama.cpp's norms multiply by the weight;
        Qwen3.5's by 1 + w. In float32 (w + 1) - 1 + 1 == w + 1 exactly, so a round trip keeps the logits)
    A_log -> ssm_a = -exp(A_log)   (read back as log(-ssm_a); ssm_a must be negative)
    conv1d [C, 1, K] -> [C, K]
    when linear_num_value_heads Hv > linear_num_key_heads Hk: the value heads are reordered from HF's grouped
        order (the r = Hv / Hk value heads of key head 0, then key head 1's, ...) to llama.cpp's tiled order
        (value head j of every key head, for j = 0 .. r-1), on the V rows of in_proj_qkv and conv1d, the rows of
        in_proj_z / in_proj_b / in_proj_a, A_log and dt_bias, and the columns of out_proj.
    ssm_conv1d, ssm_a, ssm_dt.bias and the norms are always F32 (as the converter writes them).

Metadata (beyond the shared keys): qwen35.ssm.conv_kernel (linear_conv_kernel_dim), ssm.state_size
(linear_key_head_dim), ssm.group_count (Hk), ssm.time_step_rank (Hv), ssm.inner_size (Hv * linear_value_head_dim),
attention.recurrent_layers (per layer: a DeltaNet layer), full_attention_interval (config.json's, default 4),
rope.dimension_count (head_dim * partial_rotary_factor) and rope.dimension_sections (mrope_section padded to 4,
default [11, 11, 10, 0]). llama.cpp itself runs only files with linear_key_head_dim == linear_value_head_dim
(its ssm.state_size serves both); surojax reads the value head dim as inner_size / time_step_rank. MTP layers are
not written (the converter's --no-mtp); a file with `nextn_predict_layers` has them skipped when read.
qwen35moe adds (gguf_checkpoint writes them, as for qwen3moe) expert_count, expert_used_count,
expert_feed_forward_length (moe_intermediate_size) and expert_shared_feed_forward_length
(shared_expert_intermediate_size), and has no feed_forward_length (the family has no dense MLP); read back, a file
without the two widths gets llama.cpp's fallbacks (feed_forward_length / expert_used_count and feed_forward_length).
"""
from __future__ import annotations

import numpy as np

from surojax.models.config import ModelConfig
from surojax.models.registry import family_for
from surojax.weights.gguf_reader import GGUFError

ARCH = "qwen35"
MOE_ARCH = "qwen35moe"
HYBRID_ARCHS = (ARCH, MOE_ARCH)
# general.architecture -> what a file reads back as (the text model; no vision tower in the file)
MODEL_TYPES = {ARCH: "qwen3_5_text", MOE_ARCH: "qwen3_5_moe_text"}
DEFAULT_MROPE_SECTION = (11, 11, 10, 0)  # the converter's, when config.json has none

_L = "model.layers.{i}."
NAMES: dict[str, str] = {
    _L + "post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    _L + "linear_attn.in_proj_qkv.weight": "blk.{i}.attn_qkv.weight",
    _L + "linear_attn.in_proj_z.weight": "blk.{i}.attn_gate.weight",
    _L + "linear_attn.in_proj_b.weight": "blk.{i}.ssm_beta.weight",
    _L + "linear_attn.in_proj_a.weight": "blk.{i}.ssm_alpha.weight",
    _L + "linear_attn.conv1d.weight": "blk.{i}.ssm_conv1d.weight",
    _L + "linear_attn.dt_bias": "blk.{i}.ssm_dt.bias",
    _L + "linear_attn.A_log": "blk.{i}.ssm_a",
    _L + "linear_attn.norm.weight": "blk.{i}.ssm_norm.weight",
    _L + "linear_attn.out_proj.weight": "blk.{i}.ssm_out.weight",
}
_F32_SUFFIXES = ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")


def text_name(hf_name: str) -> str:
    """The name in the text-only layout (Qwen3_5ForConditionalGeneration's `model.language_model.` -> `model.`)."""
    return hf_name.replace("model.language_model.", "model.", 1)


def forced_f32(gguf_name: str) -> bool:
    """Tensors the converter (and llama-quantize) keep in F32 whatever the file type."""
    return gguf_name.endswith(_F32_SUFFIXES)


def _tiled(hk: int, r: int, head_dim: int) -> np.ndarray:
    """Index map grouped -> tiled: file position p holds the grouped (HF) index out[p]."""
    return np.arange(hk * r * head_dim).reshape(hk, r, head_dim).swapaxes(0, 1).reshape(-1)


def value_head_order(cfg: ModelConfig, hf_name: str) -> tuple[int, np.ndarray] | None:
    """(axis, index map) such that the file's tensor is the HF tensor (HF layout [out, in], conv [C, K]) taken at
    the map along the axis; None when nothing moves (Hv == Hk, or a tensor without value heads)."""
    la = cfg.linear_attention
    r = la.num_value_heads // la.num_key_heads
    if r == 1 or ".linear_attn." not in hf_name:
        return None
    hk, dv, qk = la.num_key_heads, la.value_head_dim, 2 * la.key_dim
    part = hf_name.rsplit(".linear_attn.", 1)[1]
    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        return 0, np.concatenate([np.arange(qk), qk + _tiled(hk, r, dv)])
    if part == "in_proj_z.weight":
        return 0, _tiled(hk, r, dv)
    if part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return 0, _tiled(hk, r, 1)
    if part == "out_proj.weight":
        return 1, _tiled(hk, r, dv)
    return None


def _shifted_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")


def file_shape(hf_name: str, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The numpy-order shape of the file's tensor for an HF tensor of `hf_shape`."""
    if hf_name.endswith("linear_attn.conv1d.weight"):
        return (hf_shape[0], hf_shape[-1])
    return tuple(hf_shape)


def to_file(cfg: ModelConfig, hf_name: str, w: np.ndarray) -> np.ndarray:
    """An HF tensor (float32, HF layout) -> the file's values (float32, numpy order)."""
    if _shifted_norm(hf_name):
        w = w + np.float32(1)
    elif hf_name.endswith(".A_log"):
        w = -np.exp(w)
    elif hf_name.endswith("linear_attn.conv1d.weight"):
        w = w.reshape(w.shape[0], w.shape[-1])
    order = value_head_order(cfg, hf_name)
    if order is not None:
        w = np.take(w, order[1], axis=order[0])
    return np.ascontiguousarray(w, np.float32)


def from_file(cfg: ModelConfig, hf_name: str, a: np.ndarray, gguf_name: str, source: str) -> np.ndarray:
    """The file's values (float32, numpy order) -> the HF tensor (HF layout); GGUFError for an ssm_a that is not
    negative everywhere (it is -exp(A_log))."""
    order = value_head_order(cfg, hf_name)
    if order is not None:
        a = np.take(a, np.argsort(order[1]), axis=order[0])
    if _shifted_norm(hf_name):
        return a - np.float32(1)
    if hf_name.endswith(".A_log"):
        if not np.all(a < 0):
            raise GGUFError(f"{source}: tensor {gguf_name}: expected negative values (-exp(A_log)), found "
                            f"{float(np.max(a))}")
        return np.log(-a)
    if hf_name.endswith("linear_attn.conv1d.weight"):
        return a.reshape(a.shape[0], 1, a.shape[1])
    return a


def quantised_rows_order(cfg: ModelConfig, hf_name: str) -> np.ndarray | None | bool:
    """For a quantised Linear read with its bytes kept: the row map to undo on the file's rows (None: none),
    or False when the reorder moves columns inside quantisation blocks (out_proj with Hv > Hk: dequantised)."""
    order = value_head_order(cfg, hf_name)
    if order is None:
        return None
    return np.argsort(order[1]) if order[0] == 0 else False


def _text_config(cfg: ModelConfig) -> dict:
    hf = cfg.hf_extra or {}
    return (hf.get("text_config") or {}) if family_for(cfg.model_type).text_config else hf


def write_metadata(w, cfg: ModelConfig) -> None:
    """The qwen35 keys beyond the shared ones (see the module docstring); `w` a gguf.GGUFWriter."""
    la = cfg.linear_attention
    text = _text_config(cfg)
    w.add_ssm_conv_kernel(la.conv_kernel)
    w.add_ssm_state_size(la.key_head_dim)
    w.add_ssm_group_count(la.num_key_heads)
    w.add_ssm_time_step_rank(la.num_value_heads)
    w.add_ssm_inner_size(la.value_dim)
    w.add_array(f"{w.arch}.attention.recurrent_layers", [bool(x) for x in la.layers])
    w.add_full_attention_interval(int(text.get("full_attention_interval", 4)))
    w.add_rope_dimension_count(cfg.rotary_dim)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)
    if sum(section) > cfg.rotary_dim // 2:  # llama.cpp asserts on such a file when it runs it (GGML_ASSERT sect_dims)
        raise GGUFError(f"rope_parameters.mrope_section {section} gives {sum(section)} rotary frequency pairs, but the "
                        f"rotary dimension {cfg.rotary_dim} has {cfg.rotary_dim // 2}: set mrope_section to sum to "
                        f"{cfg.rotary_dim // 2} (the config's text sections) before writing a {w.arch} GGUF")
    w.add_rope_dimension_sections((section + [0, 0, 0, 0])[:4])


def hf_config(get, fields: dict, hf: dict, source: str, arch: str) -> None:
    """Add the Qwen3.5 keys of config.json to `hf` (built from the shared keys) from the metadata of a file of
    `arch` (qwen35 / qwen35moe); `get(key, kind, default)` reads `<arch>.<key>` type-checked. MTP layers
    (nextn_predict_layers) are left out of the layer count."""
    n_mtp = get("nextn_predict_layers", default=0)
    layers = hf["num_hidden_layers"] - n_mtp
    if layers < 1:
        raise GGUFError(f"{source}: {arch}.block_count {hf['num_hidden_layers']} leaves no layer besides the "
                        f"{n_mtp} MTP layers")
    hk, hv = get("ssm.group_count"), get("ssm.time_step_rank")
    inner = get("ssm.inner_size")
    if hk == 0 or hv == 0 or hv % hk or inner % hv:
        raise GGUFError(f"{source}: {arch}.ssm.group_count {hk}, ssm.time_step_rank {hv}, ssm.inner_size {inner}: "
                        "expected positive head counts, the value heads a multiple of the key heads and the inner "
                        "size a multiple of the value heads")
    key = f"{arch}.attention.recurrent_layers"
    recurrent = fields.get(key)
    if recurrent is None:
        interval = get("full_attention_interval", default=4) or 4
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    elif not (isinstance(recurrent, list) and len(recurrent) >= layers and all(type(x) is bool for x in recurrent)):
        raise GGUFError(f"{source}: metadata key {key}: expected {layers} booleans, found {recurrent!r:.80}")
    rot = get("rope.dimension_count", default=hf["head_dim"])
    sections = fields.get(f"{arch}.rope.dimension_sections", list(DEFAULT_MROPE_SECTION))
    if not (isinstance(sections, list) and len(sections) >= 3 and all(type(s) is int for s in sections)):
        raise GGUFError(f"{source}: metadata key {arch}.rope.dimension_sections: expected 4 integers, found "
                        f"{sections!r:.80}")
    partial = rot / hf["head_dim"]
    hf.update(num_hidden_layers=layers,
              layer_types=["linear_attention" if x else "full_attention" for x in recurrent[:layers]],
              linear_conv_kernel_dim=get("ssm.conv_kernel"), linear_key_head_dim=get("ssm.state_size"),
              linear_num_key_heads=hk, linear_num_value_heads=hv, linear_value_head_dim=inner // hv,
              partial_rotary_factor=partial,
              rope_parameters={"rope_type": "default", "rope_theta": hf["rope_theta"],
                               "partial_rotary_factor": partial, "mrope_section": list(sections[:3]),
                               "mrope_interleaved": True})
    if f"{arch}.full_attention_interval" in fields:
        hf["full_attention_interval"] = get("full_attention_interval")
