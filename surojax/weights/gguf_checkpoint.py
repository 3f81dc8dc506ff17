"""A `Decoder` <-> a llama.cpp GGUF file (llama / qwen2 / qwen3 / qwen3moe / qwen35 / qwen35moe / gemma3 / gemma4 /
lfm2 / lfm2moe architectures, Mixtral as llama), through the `gguf` package's GGUFWriter and our checked reader
(surojax.weights.gguf_reader: every count and offset bounded by the file size).

    save_gguf(model_or_hf_dir, "out.gguf", "q4_k_m", tokenizer_dir=...)       # what `surojax quantize` runs
    cfg, model, tokenizer = load_gguf_model("model.gguf", dtype=jnp.bfloat16)  # the training base

Names and layout. The weight table below maps HF names to llama.cpp's (token_embd, blk.N.attn_q / attn_k /
attn_v / attn_output, attn_q_norm / attn_k_norm (qwen3), attn_q.bias .. (qwen2), attn_norm, ffn_norm, ffn_gate /
ffn_up / ffn_down, output_norm, output). A GGUF 2-D tensor is the HF [out, in] matrix row-major (its `ne` lists
[in, out]), so an HF weight is written as is, quantised along its rows. For the llama architecture llama.cpp
applies rotary embeddings to interleaved pairs while HF rotates halves; convert_hf_to_gguf therefore permutes the
rows of q_proj / k_proj (per head: rows [0, H/2) and [H/2, H) interleaved), and `_rope_permute` does the same
(writing) and its inverse (reading). qwen2 / qwen3 use the NeoX (half) rotation in llama.cpp: no permutation.
Llama 3 rope scaling is the `rope_freqs.weight` tensor of per-frequency factors (as convert_hf_to_gguf makes it).

MoE (qwen3_moe as `qwen3moe`, mixtral as `llama` with experts, qwen3_5_moe as `qwen35moe`): the file holds the
fused HF rows (registry.FUSED_MOE_WEIGHTS) under llama.cpp's names: blk.N.ffn_gate_inp (router [E, D], always F32,
as convert_hf_to_gguf writes it and llama-quant keeps it), blk.N.ffn_gate_exps / ffn_up_exps (the two halves of
gate_up_proj [E, 2F, D]) and ffn_down_exps [E, D, F] (numpy order; GGUF ne [in, out, E]), each expert's rows
quantised like a 2-D weight's; a shared expert (qwen3_5_moe) as ffn_gate_shexp / ffn_up_shexp / ffn_down_shexp
and its sigmoid gate ffn_gate_inp_shexp ([1, D], always F32 like the router); metadata {arch}.expert_count /
expert_used_count (+ expert_feed_forward_length for qwen3moe / qwen35moe, expert_shared_feed_forward_length with a
shared expert; the llama arch's feed_forward_length is the expert's, qwen35moe has none). llama.cpp renormalises
the top-k weights for all three, so norm_topk_prob false is refused on write. Read back, quantised experts stay
quantised ([L, E, ...] leaves) when their format has `grouped_matmul` and every layer has one type, else they are
dequantised.

Metadata (as convert_hf_to_gguf writes it): general.architecture / name / file_type / quantization_version,
<arch>.context_length / embedding_length / feed_forward_length / block_count / vocab_size,
attention.head_count / head_count_kv / key_length / value_length / layer_norm_rms_epsilon, rope.freq_base /
dimension_count (+ rope.scaling.type / factor for linear scaling) and the tokenizer (surojax.weights.gguf_tokenizer).

Reading keeps quantised Linear kernels quantised (keep_quantized=True): the file's raw block bytes become the
matching surojax.quant format (GGUFQuant.from_gguf, no conversion: the storage layouts are the same), stacked
over layers in a `QuantParam`, exactly as `quantize_model` leaves a model. A target whose layers have different
types in the file (llama.cpp's Q4_K_M gives attn_v / ffn_down Q6_K on some layers only) is kept as one
`GGUFMixed` pytree (surojax.quant.gguf_mixed: each layer's bytes in its own type, padded to the widest row).
Embeddings, norms, biases and the LM head are dequantised to `param_dtype`.

Qwen3.5's hybrid (qwen3_5_text, qwen3_5: architecture `qwen35`, read back as qwen3_5_text; qwen3_5_moe_text,
qwen3_5_moe: `qwen35moe`, read back as qwen3_5_moe_text) has its own names, per-tensor transforms ((1 + w) norms
stored as 1 + w, A_log as -exp(A_log), llama.cpp's value-head order) and metadata: surojax.weights.gguf_qwen35.
Its files are written as f32 / f16 / bf16 / q8_0, what llama.cpp's converter writes; files quantised further by
llama-quantize are read like any other.

Gemma 3 (gemma3_text, gemma3: `gemma3`, read back as gemma3_text), Gemma 4 (gemma4_text, gemma4: `gemma4`, read
back as gemma4_text), LFM2 (`lfm2`) and LFM2-MoE (`lfm2moe`) likewise have their own names, transforms and metadata
(surojax.weights.gguf_gemma3, gguf_gemma4, gguf_lfm2: TRANSFORMS (Gemma 4 has none: its values are written as they
are, plus its rope_freqs.weight), and OWN_METADATA, which writes and reads their keys whole), the same four file
types, and refuse by name what llama.cpp's graphs would run differently.

A model split in several files (`name-00001-of-00003.gguf`, gguf-split / GGUFWriter's split options) is read
whole from any part's name (surojax.weights.gguf_split): metadata from the first part, tensors from all.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.config import ModelConfig, ModelConfigError
from surojax.models.decoder import Decoder
from surojax.models.layers.attention_backend import AttentionBackend
from surojax.models.registry import family_for, row_layers, weight_rows
from surojax.quant import FORMATS, GGUF_TYPES
from surojax.quant.base import QuantFormat
from surojax.quant.gguf_mixed import GGUFMixed
from surojax.quant.transform import QuantParam
from surojax.weights.atomic import AtomicFile
from surojax.weights.gguf_reader import GGUFError, GGUFFile
from surojax.weights import gguf_gemma3 as gemma3
from surojax.weights import gguf_gemma4 as gemma4
from surojax.weights import gguf_lfm2 as lfm2
from surojax.weights import gguf_qwen35 as qwen35
from surojax.weights.gguf_split import read_gguf_model
from surojax.weights.gguf_tokenizer import add_tokenizer, tokenizer_from_fields, tokenizer_metadata
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import WeightsError

log = logging.getLogger(__name__)

# our model_type -> general.architecture (llama.cpp runs Mixtral as `llama` with {arch}.expert_count > 0)
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
         "qwen3_5_text": qwen35.ARCH, "qwen3_5": qwen35.ARCH, "qwen3_5_moe_text": qwen35.MOE_ARCH,
         "qwen3_5_moe": qwen35.MOE_ARCH, "gemma3_text": gemma3.ARCH, "gemma3": gemma3.ARCH, "lfm2": lfm2.ARCH,
         "lfm2_moe": lfm2.MOE_ARCH, "gemma4_text": gemma4.ARCH, "gemma4": gemma4.ARCH}
# general.architecture -> the model_type a file reads back as (llama with experts: mixtral, below)
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", **qwen35.MODEL_TYPES,
               gemma3.ARCH: gemma3.MODEL_TYPE, lfm2.ARCH: lfm2.MODEL_TYPE,
               lfm2.MOE_ARCH: lfm2.MOE_MODEL_TYPE, gemma4.ARCH: gemma4.MODEL_TYPE}
# the model_types read from a file with experts ({arch}.expert_count > 0): their MoE config.json keys
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen3_5_moe_text", "lfm2_moe")
# ... and those that may have experts or not (gemma4_text: its MoE block)
OPTIONAL_MOE_MODEL_TYPES = (gemma4.MODEL_TYPE,)
# HF name -> llama.cpp name ("{i}" is the layer); rows absent from a family are simply not present
GGUF_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    # MoE (read from / written as the fused HF rows, registry.FUSED_MOE_WEIGHTS): the router [E, D] and the
    # experts merged per layer, numpy [E, out, in] (GGUF ne [in, out, E]); gate_up is split below
    "model.layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",
    "model.layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
    # a shared expert (qwen3_5_moe) and its sigmoid gate [1, D]
    "model.layers.{i}.mlp.shared_expert.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
    "model.layers.{i}.mlp.shared_expert.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
    "model.layers.{i}.mlp.shared_expert.down_proj.weight": "blk.{i}.ffn_down_shexp.weight",
    "model.layers.{i}.mlp.shared_expert_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
}
# per-architecture names that differ from (or add to) GGUF_NAMES
ARCH_NAMES: dict[str, dict[str, str]] = {**{arch: qwen35.NAMES for arch in qwen35.HYBRID_ARCHS},
                                         gemma3.ARCH: gemma3.NAMES, lfm2.ARCH: lfm2.NAMES,
                                         lfm2.MOE_ARCH: lfm2.MOE_NAMES, gemma4.ARCH: gemma4.NAMES}
# architectures whose tensors have per-tensor transforms (to_file / from_file / file_shape / forced_f32)
TRANSFORMS = {qwen35.ARCH: qwen35, qwen35.MOE_ARCH: qwen35, gemma3.ARCH: gemma3, lfm2.ARCH: lfm2, lfm2.MOE_ARCH: lfm2}
# architectures whose metadata a module writes whole (write_metadata(w, cfg, gguf)): the converter writes no
# rope.dimension_count / key_length for them, or its keys differ per layer
OWN_METADATA = {gemma3.ARCH: gemma3, lfm2.ARCH: lfm2, lfm2.MOE_ARCH: lfm2, gemma4.ARCH: gemma4}
# HF rows written as several GGUF tensors, concatenated along the out rows (numpy axis -2) when read:
# gate_up_proj [E, 2F, D] = [ffn_gate_exps | ffn_up_exps]
GGUF_PARTS: dict[str, tuple[str, ...]] = {
    "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
    **lfm2.MOE_PARTS,  # lfm2_moe's feed_forward.experts.gate_up_proj
}
# the routers and the shared expert's gate: kept F32 in every file type (convert_hf_to_gguf and llama-quant do)
ROUTER_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
ROPE_FREQS = "rope_freqs.weight"
# the file types convert_hf_to_gguf writes for qwen35 / qwen35moe / gemma3 / gemma4 / lfm2 / lfm2moe (the only
# ones whose per-tensor types are known for them)
HYBRID_FILE_TYPES = ("f32", "f16", "bf16", "q8_0")
CONVERTER_TYPES_ONLY = (*qwen35.HYBRID_ARCHS, gemma3.ARCH, gemma4.ARCH, *lfm2.ARCHS)


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - the package is a dependency
        raise WeightsError("reading or writing GGUF files needs the `gguf` package (pip install gguf)") from e
    return gguf


# -- layout helpers ---------------------------------------------------------------------------------------------
def _rope_permute(w: np.ndarray, n_head: int, inverse: bool = False) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute on the rows of w [n_head * H, ...] (any trailing row shape, so
    raw quantised rows work too); `inverse` undoes it."""
    rows = w.shape[0]
    if inverse:
        return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_heads(cfg: ModelConfig, hf_name: str) -> int | None:
    """Heads to rope-permute this tensor over (the llama architecture: llama, mixtral), else None."""
    if ARCHS.get(cfg.model_type) != "llama":
        return None
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return cfg.num_heads
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return cfg.num_kv_heads
    return None


def llama3_rope_factors(cfg: ModelConfig) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf computes it for rope_type llama3 (float32 [H/2])."""
    rs, dim = cfg.rope_scaling, cfg.head_dim
    # theta ** (i / dim) by libm's float64 pow, rounded once to float32: the correctly rounded float32 power.
    # numpy's float32 power (its SIMD loops) is 1 ulp off on some CPUs, which made the written bytes depend on the
    # machine. The rest is float32 arithmetic, as the converter's torch loop.
    exps = np.arange(0, dim, 2, dtype=np.float32) / dim
    freqs = np.float32(1.0) / np.asarray([math.pow(cfg.rope_theta, float(e)) for e in exps], np.float32)
    low, high = rs.original_max_position_embeddings / rs.low_freq_factor, \
        rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(rs.factor)
        else:
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / \
                (rs.high_freq_factor - rs.low_freq_factor)
            out.append(1 / ((1 - smooth) / rs.factor + smooth))
    return np.asarray(out, np.float32)


def encode_values(w: np.ndarray, qtype: str):
    """HF-layout float32 [N, K] (or merged experts [E, N, K]) -> (array to write, raw_dtype or None); quantised
    along the rows of K values: raw bytes [N, row bytes] ([E, N, row bytes])."""
    gguf = _gguf()
    if qtype == "f32":
        return np.ascontiguousarray(w, np.float32), None
    if qtype == "f16":
        return np.ascontiguousarray(w.astype(np.float16)), None

    rows = w.reshape(-1, w.shape[-1])  # [E*N, K]
    data = np.asarray(FORMATS[qtype].quantize(rows.T).data)  # the format quantises rows.T's columns = the rows
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(*w.shape[:-1], -1)
    return raw, gguf.GGMLQuantizationType[qtype.upper()]


# -- writing ----------------------------------------------------------------------------------------------------
def _rows(cfg: ModelConfig):
    """The weight rows a GGUF file holds: a MoE family's fused table (one router and merged experts per layer,
    as llama.cpp stores them), the published table otherwise (Gemma 4's, whose experts are published fused)."""
    return weight_rows(cfg, fused=cfg.moe is not None and bool(family_for(cfg.model_type).fused_weights))


def _ordered(cfg: ModelConfig) -> list[str]:
    """HF names in llama.cpp's order: embeddings, each layer's tensors, final norm, head."""
    table = _rows(cfg)
    rows = [r.hf for r in table]
    last = [n for n in rows if qwen35.text_name(n) in ("model.norm.weight", "lm_head.weight")]
    out = [n for n in rows if "{i}" not in n and n not in last]
    for i in range(cfg.num_layers):
        out += [r.hf.format(i=i) for r in table if r.per_layer and i in row_layers(cfg, r)]
    return out + last


def gguf_names(hf_name: str, arch: str | None = None) -> tuple[str, ...]:
    """The GGUF tensor(s) of one HF tensor of a file of architecture `arch` (None: the llama-style names): one, or
    the parts of a split row (GGUF_PARTS), in order. A multimodal checkpoint's `model.language_model.` reads as
    `model.`."""
    hf_name = qwen35.text_name(hf_name)
    m = re.match(r"model\.layers\.(\d+)\.(.*)", hf_name)
    key = f"model.layers.{{i}}.{m.group(2)}" if m else hf_name
    table = {**GGUF_NAMES, **ARCH_NAMES.get(arch, {})}
    names = GGUF_PARTS.get(key) or ((table[key],) if key in table else None)
    if names is None:
        raise WeightsError(f"no GGUF name for tensor {hf_name}")
    return tuple(n.format(i=m.group(1)) for n in names) if m else names


def gguf_name(hf_name: str, arch: str | None = None) -> str:
    names = gguf_names(hf_name, arch)
    if len(names) != 1:
        raise WeightsError(f"tensor {hf_name} is written as {len(names)} GGUF tensors: {', '.join(names)}")
    return names[0]


def _stored_dtype(model_dir):
    """bfloat16 when config.json says the checkpoint is bf16 (loading it so is lossless and halves the memory),
    else float32."""
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return jnp.float32
    return jnp.bfloat16 if (hf.get("torch_dtype") or hf.get("dtype")) == "bfloat16" else jnp.float32


def _hf_tensor_reader(model: Decoder):
    """HF tensor name -> float32 numpy array in HF layout, made on demand (the weight table, as hf_tensors)."""
    cfg = model.cfg
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    rows = {}
    for row in _rows(cfg):
        for r, i in enumerate(row_layers(cfg, row)):  # r: the row in its stack, i: the HF layer
            rows[row.hf.format(i=i) if i is not None else row.hf] = (row, None if i is None else r)

    def get(hf_name: str) -> np.ndarray:
        row, i = rows[hf_name]
        value = flat[row.path].get_value()
        if isinstance(value, QuantFormat):
            raise WeightsError(f"save_gguf: {row.path} is quantised ({value.name}); write the unquantised model "
                               "(merge the adapter into the HF base first)")
        value = value[i] if i is not None else value
        arr = np.asarray(jax.device_get(value), np.float32)
        return np.swapaxes(arr, -1, -2) if row.transpose else arr  # HF [.., out, in]
    return get


def save_gguf(model, path: str | os.PathLike, file_type: str = "q8_0", *,
              tokenizer_dir: str | os.PathLike | None = None, name: str | None = None,
              encode: Callable[[np.ndarray, str], tuple] = encode_values) -> Path:
    """Write `model` (a Decoder, or an HF model folder to load) as a llama.cpp GGUF of `file_type` (a key of
    surojax.quant.quantize_mix.FILE_TYPES: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_m, q4_k_m,
    q5_k_m, q6_k), with the tokenizer of `tokenizer_dir` (default: the model folder). The file is written under a
    temporary name and renamed at the end. `encode(tensor, ggml type name)` makes each weight matrix's bytes
    (`encode_values`: the tensor's values in that type; benchmarks/anchors/random_gguf.py: random codes)."""
    # lazy: quantize_mix needs the optional `gguf` package (absent from the GPU image); loading does not
    from surojax.quant.quantize_mix import FILE_TYPES, tensor_type

    gguf = _gguf()
    if isinstance(model, (str, os.PathLike)):
        tokenizer_dir = tokenizer_dir or model
        name = name or Path(model).name
        model = load_model(model, dtype=jnp.float32, param_dtype=_stored_dtype(model))
    if tokenizer_dir is None:
        raise WeightsError("save_gguf: tokenizer_dir is needed (a GGUF file carries its tokenizer)")
    if file_type not in FILE_TYPES:
        raise WeightsError(f"unknown GGUF file type {file_type!r}; choose from {', '.join(FILE_TYPES)}")
    cfg = model.cfg
    arch = ARCHS.get(cfg.model_type)
    if arch is None or (cfg.sliding_window and arch not in (gemma3.ARCH, gemma4.ARCH)):
        raise WeightsError(f"model_type {cfg.model_type!r}{' with sliding_window' if cfg.sliding_window else ''} "
                           f"cannot be written to GGUF here (supported: {', '.join(ARCHS)})")
    if cfg.rope_scaling.rope_type not in ("default", "linear", "llama3") and arch != gemma4.ARCH:
        raise WeightsError(f"rope_scaling {cfg.rope_scaling.rope_type!r} cannot be written to GGUF")
    transforms = TRANSFORMS.get(arch)
    if arch in OWN_METADATA:
        OWN_METADATA[arch].check_writable(cfg)  # before any heavy work
    if arch in CONVERTER_TYPES_ONLY and file_type not in HYBRID_FILE_TYPES:
        raise WeightsError(f"{cfg.model_type} is written to GGUF as {', '.join(HYBRID_FILE_TYPES)} (what llama.cpp's "
                           f"convert_hf_to_gguf writes), not {file_type!r}: llama.cpp's per-tensor mix of the other "
                           f"file types for the {arch} architecture is not modelled here (run llama-quantize on the "
                           "f16 / f32 file)")
    if cfg.moe is not None and not cfg.moe.norm_topk_prob:
        raise WeightsError(f"{cfg.model_type} with norm_topk_prob false cannot be written to GGUF (llama.cpp's "
                           f"{arch} graph always renormalises the top-k routing weights)")
    path = Path(path)
    tok_meta = tokenizer_metadata(tokenizer_dir, cfg.vocab_size)
    tensor = _hf_tensor_reader(model)

    out = AtomicFile(path)
    w = gguf.GGUFWriter(str(out.tmp), arch)
    try:
        w.add_name(name or "surojax-model")
        w.add_file_type(int(FILE_TYPES[file_type][0]))
        if file_type not in ("f32", "f16", "bf16"):
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if arch in OWN_METADATA:
            OWN_METADATA[arch].write_metadata(w, cfg, gguf)
        else:
            _write_shared_metadata(w, cfg, arch, gguf)
        add_tokenizer(w, tok_meta)

        if cfg.rope_scaling.rope_type == "llama3":
            w.add_tensor(ROPE_FREQS, llama3_rope_factors(cfg))
        elif arch == gemma4.ARCH:  # the full layers' proportional rope
            w.add_tensor(ROPE_FREQS, gemma4.rope_freqs(cfg))
        tied = cfg.tie_word_embeddings
        n_gqa = cfg.num_heads // cfg.num_kv_heads
        for hf in _ordered(cfg):
            arr = tensor(hf)  # one tensor at a time in float32: a large model never sits whole in float32
            heads = _permute_heads(cfg, hf)
            if heads:
                arr = _rope_permute(arr, heads)
            if transforms:
                arr = transforms.to_file(cfg, hf, arr)
            names = gguf_names(hf, arch)
            for gname, part in zip(names, np.split(arr, len(names), axis=-2) if len(names) > 1 else [arr]):
                if part.ndim == 1 or (transforms and transforms.forced_f32(gname)):
                    w.add_tensor(gname, np.ascontiguousarray(part, np.float32))
                    continue
                qtype = "f32" if gname.endswith(ROUTER_SUFFIXES) else tensor_type(
                    file_type, gname, part.shape[-1], n_layers=cfg.num_layers, n_gqa=n_gqa, tied=tied, arch=arch)
                data, raw = encode(part, qtype)
                w.add_tensor(gname, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out.commit()
    except BaseException:
        w.close()
        out.discard()
        raise
    return path


def _write_shared_metadata(w, cfg: ModelConfig, arch: str, gguf) -> None:
    """The llama-style keys (every architecture but OWN_METADATA's)."""
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if cfg.model_type == "mixtral":  # llama.cpp's llama arch: n_ff = expert F
        w.add_feed_forward_length(cfg.moe.expert_intermediate_size)
    elif family_for(cfg.model_type).intermediate_size_key:  # qwen3_5_moe has no dense MLP width
        w.add_feed_forward_length(cfg.intermediate_size)
    if cfg.moe is not None:
        w.add_expert_count(cfg.moe.num_experts)
        w.add_expert_used_count(cfg.moe.experts_per_token)
        if arch in ("qwen3moe", qwen35.MOE_ARCH):
            w.add_expert_feed_forward_length(cfg.moe.expert_intermediate_size)
        if cfg.moe.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.moe.shared_expert_intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if arch in qwen35.HYBRID_ARCHS:
        qwen35.write_metadata(w, cfg)  # its rope.dimension_count is the rotary part
    else:
        w.add_rope_dimension_count(cfg.head_dim)
    if cfg.rope_scaling.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)


# -- reading ----------------------------------------------------------------------------------------------------
def _typed(fields: dict, key: str, kind: type, source: str, default=None):
    """fields[key] checked to be a `kind` (int: a non-negative integer; float: any number; str), else a GGUFError
    naming the key; `default` when absent (None: the key is required)."""
    if key not in fields:
        if default is None:
            raise GGUFError(f"{source}: metadata key {key} is missing")
        return default
    v = fields[key]
    ok = {int: type(v) is int and v >= 0, float: type(v) in (int, float), str: type(v) is str}[kind]
    if not ok:
        want = {int: "a non-negative integer", float: "a number", str: "a string"}[kind]
        raise GGUFError(f"{source}: metadata key {key}: expected {want}, found {type(v).__name__} {_short(v)}")
    return kind(v)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def hf_config_from_gguf(fields: dict, source: str, n_tensors: int | None = None) -> dict:
    """The config.json dict (HF keys) that the GGUF metadata describes. Every value is type-checked (GGUFError
    naming the key); `n_tensors` (the file's tensor count), when given, bounds the block count."""
    arch = fields.get("general.architecture")
    model_type = MODEL_TYPES.get(arch) if isinstance(arch, str) else None
    if model_type is None:
        raise GGUFError(f"{source}: general.architecture: expected one of {', '.join(sorted(MODEL_TYPES))}, "
                        f"found {_short(arch)}")

    def get(key, kind=int, default=None):
        return _typed(fields, f"{arch}.{key}", kind, source, default)

    experts = get("expert_count", default=0)
    if model_type == "llama" and experts:
        model_type = "mixtral"
    elif model_type in MOE_MODEL_TYPES and not experts:
        raise GGUFError(f"{source}: {arch}.expert_count: expected a positive expert count, found {experts}")
    elif experts and model_type not in MOE_MODEL_TYPES + OPTIONAL_MOE_MODEL_TYPES:
        raise GGUFError(f"{source}: {arch}.expert_count {experts}: experts are read for qwen3moe, qwen35moe, "
                        f"lfm2moe, gemma4 and llama (Mixtral) files only")

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    if n_heads == 0 or hidden == 0:
        raise GGUFError(f"{source}: {arch}.attention.head_count and {arch}.embedding_length: expected positive "
                        f"values, found {n_heads} and {hidden}")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", default=0) or (len(tokens) if isinstance(tokens, list) else 0)
    if not vocab:
        raise GGUFError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocab size")
    layers = get("block_count")
    if n_tensors is not None and layers > n_tensors:
        raise GGUFError(f"{source}: {arch}.block_count: expected at most the file's {n_tensors} tensors, "
                        f"found {layers}")
    per_layer = arch in (*lfm2.ARCHS, gemma4.ARCH)  # their head_count_kv (gemma4: feed_forward_length) per layer
    hf = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
          "num_attention_heads": n_heads,
          "num_key_value_heads": n_heads if per_layer else get("attention.head_count_kv", default=n_heads),  # per
          # layer: their module reads it
          "head_dim": get("attention.key_length", default=hidden // n_heads),
          "rms_norm_eps": get("attention.layer_norm_rms_epsilon", float, 1e-6),
          "rope_theta": get("rope.freq_base", float, 10000.0),
          "max_position_embeddings": get("context_length", default=4096)}
    if family_for(model_type).intermediate_size_key and arch != gemma4.ARCH:  # qwen3_5_moe has no dense MLP
        hf["intermediate_size"] = get("feed_forward_length")
    scaling = get("rope.scaling.type", str, "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", float)}
    elif scaling != "none":
        raise GGUFError(f"{source}: {arch}.rope.scaling.type: expected none or linear (Llama 3 scaling comes "
                        f"through rope_freqs.weight), found {scaling!r}")
    if model_type == "qwen3_moe":  # llama.cpp's qwen3moe graph renormalises the top-k weights
        hf.update(num_experts=experts, num_experts_per_tok=get("expert_used_count"), norm_topk_prob=True,
                  moe_intermediate_size=get("expert_feed_forward_length"))
    elif model_type == lfm2.MOE_MODEL_TYPE:  # the rest of its MoE keys: gguf_lfm2.hf_config
        hf.update(num_experts=experts, num_experts_per_tok=get("expert_used_count"))
    elif model_type == "mixtral":  # the llama arch's n_ff is the expert's
        hf.update(num_local_experts=experts, num_experts_per_tok=get("expert_used_count"))
    elif model_type == "qwen3_5_moe_text":  # without the widths, llama.cpp's fallbacks from feed_forward_length
        used, n_ff = get("expert_used_count"), get("feed_forward_length", default=0)
        expert_ff = get("expert_feed_forward_length", default=0) or n_ff // max(used, 1)
        shared_ff = get("expert_shared_feed_forward_length", default=0) or n_ff
        if not (used and expert_ff and shared_ff):
            raise GGUFError(f"{source}: {arch}.expert_used_count {used}, expert_feed_forward_length {expert_ff} and "
                            f"expert_shared_feed_forward_length {shared_ff} (or feed_forward_length): expected "
                            "positive values (every layer has routed experts and the shared expert)")
        hf.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=expert_ff,
                  shared_expert_intermediate_size=shared_ff)
    if arch in qwen35.HYBRID_ARCHS:
        qwen35.hf_config(get, fields, hf, source, arch)
    elif arch in OWN_METADATA:
        OWN_METADATA[arch].hf_config(get, fields, hf, source)
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "pad")):
        if f"tokenizer.ggml.{name}_token_id" in fields:
            hf[key] = _typed(fields, f"tokenizer.ggml.{name}_token_id", int, source)
    return hf


def _llama3_from_factors(hf: dict, factors: np.ndarray, source: str) -> None:
    """Recover llama3 rope_scaling parameters from rope_freqs.weight: the factor is its largest value; the
    wavelength band gives low/high factors relative to original_max_position_embeddings. We search the usual
    Llama 3 settings and accept the one that reproduces the factors."""
    half = hf["head_dim"] // 2
    if factors.shape != (half,) or not np.all(np.isfinite(factors)):
        finite = "" if np.all(np.isfinite(factors)) else " with non-finite values"
        raise GGUFError(f"{source}: tensor {ROPE_FREQS}: expected {half} finite factors (head_dim / 2), found "
                        f"shape {list(factors.shape)}{finite}")
    factor = float(np.max(factors))
    for orig in (8192, 4096, 2048, 32, 16384, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            rs = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                  "original_max_position_embeddings": orig}
            try:
                cfg = ModelConfig.from_hf({**hf, "rope_scaling": rs})
            except ModelConfigError as e:
                raise GGUFError(f"{source}: the metadata does not make a valid model config: {e}") from None
            if np.allclose(llama3_rope_factors(cfg), factors, rtol=1e-6, atol=0):
                hf["rope_scaling"] = rs
                return
    raise GGUFError(f"{source}: tensor {ROPE_FREQS}: expected the factors of a Llama 3 rope scaling surojax can "
                    "express, found others")


def _hf_config(reader: GGUFFile, fields: dict, source: str) -> dict:
    by_name = {t.name: t for t in reader.tensors}
    hf = hf_config_from_gguf(fields, source, n_tensors=len(reader.tensors))
    factors = _dequantize(by_name[ROPE_FREQS], source) if ROPE_FREQS in by_name else None
    if hf["model_type"] == gemma4.MODEL_TYPE:  # the full layers' proportional rope, attention_k_eq_v
        gemma4.hf_from_tensors(hf, set(by_name), factors, source)
    elif factors is not None:
        _llama3_from_factors(hf, factors, source)
    hf["tie_word_embeddings"] = "output.weight" not in by_name
    if hf["model_type"] == "qwen2":
        hf["attention_bias"] = "blk.0.attn_q.bias" in by_name
    return hf


def _dequantize(t, source: str) -> np.ndarray:
    """A reader tensor -> float32 in numpy order ([N, K] for 2-D)."""
    gguf = _gguf()
    try:
        return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
    except Exception as e:
        raise GGUFError(f"{source}: tensor {t.name} ({t.tensor_type.name}) cannot be decoded: {e}") from None


def _quant_format(t, source: str):
    """A 2-D quantised reader tensor -> the surojax.quant GGUF format holding its bytes (layout [K, N] logical)."""
    cls = GGUF_TYPES.get(t.tensor_type.name.lower())
    if cls is None:
        return None
    k, n = int(t.shape[0]), int(t.shape[1])
    return cls, k, n


def load_gguf_model(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, keep_quantized: bool = True,
                    attention: AttentionBackend | str = "auto", cfg: ModelConfig | None = None):
    """Load a llama.cpp GGUF file -> (ModelConfig, Decoder, Tokenizer). See the module docstring."""
    reader, fields, source = _open(path)
    by_name = {t.name: t for t in reader.tensors}
    hf = _hf_config(reader, fields, source)
    if cfg is None:
        try:
            cfg = ModelConfig.from_hf(hf)
        except ModelConfigError as e:
            raise GGUFError(f"{source}: the metadata does not make a valid model config: {e}") from None
    tokenizer = tokenizer_from_fields(fields, source)
    param_dtype = param_dtype or dtype
    np_dtype = np.dtype(jnp.dtype(param_dtype))

    abstract_model = nnx.eval_shape(
        lambda: Decoder(cfg, dtype=dtype, param_dtype=param_dtype, attention=attention, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(abstract_model)
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(abstract)}

    rows = _rows(cfg)
    arch = ARCHS[cfg.model_type]
    hybrid = arch in qwen35.HYBRID_ARCHS
    transforms = TRANSFORMS.get(arch)
    by_path: dict[str, list] = {}  # state path -> [(layer or None, GGUF names (parts), HF name)]
    expected = set()
    for row in rows:
        for i in row_layers(cfg, row):  # HF layer indices, increasing: the stack's row order once sorted
            hf_name = row.hf.format(i=i) if i is not None else row.hf
            names = gguf_names(hf_name, arch)
            by_path.setdefault(row.path, []).append((i, names, hf_name))
            expected.update(names)
    missing = sorted(set(expected) - set(by_name))
    unexpected = sorted(set(by_name) - set(expected) - {ROPE_FREQS} - _mtp_tensors(by_name, cfg, fields))
    if missing or unexpected:
        raise GGUFError(f"{source}: the tensors do not match the {hf['model_type']} architecture in its metadata:"
                           f" missing {missing[:8]}, unexpected {unexpected[:8]}")

    values: dict[str, object] = {}
    for spath, items in by_path.items():
        row = next(r for r in rows if r.path == spath)
        want = tuple(flat[spath].get_value().shape)
        want_one = want[1:] if row.per_layer else want
        hf_shape = tuple(want_one[:-2]) + tuple(want_one[-2:][::-1]) if row.transpose else tuple(want_one)
        items.sort(key=lambda t: -1 if t[0] is None else t[0])
        for _, names, hf_name in items:
            file_shape = transforms.file_shape(hf_name, hf_shape) if transforms else hf_shape
            parts = [tuple(reversed(by_name[g].shape)) for g in names]  # numpy order
            got = parts[0][:-2] + (sum(p[-2] for p in parts),) + parts[0][-1:] if len(parts) > 1 else parts[0]
            if len({p[:-2] + p[-1:] for p in parts}) > 1 or got != file_shape:
                raise GGUFError(f"{source}: tensor {' + '.join(names)} has shape "
                                f"{' + '.join(str(list(p)) for p in parts)} (numpy order), the metadata implies "
                                f"{list(file_shape)}")
        types = {by_name[g].tensor_type for _, names, _ in items for g in names}
        linear = row.transpose and row.stack is not None  # a layer stack's Linear; the LM head is dequantised
        quant = linear and keep_quantized and any(t.name not in ("F32", "F16", "BF16") for t in types)
        experts = len(hf_shape) == 3  # merged experts [E, N, K]: kept quantised where grouped GEMMs can read them
        if quant and experts:
            quant = len(types) == 1 and all(hasattr(GGUF_TYPES.get(t.name.lower()), "grouped_matmul") for t in types)
            if not quant:
                log.info("%s: %s (%s) dequantised: %s", source, spath, sorted(t.name for t in types),
                         "per-layer types differ" if len(types) > 1 else "no grouped matmul for this format")
        if quant:
            per_layer = []
            for _, names, hf_name in items:
                specs = [_quant_format(by_name[g], source) for g in names]
                if any(spec is None for spec in specs):
                    quant = False
                    break
                cls, k = specs[0][0], specs[0][1]
                n = sum(spec[2] for spec in specs)
                raws = [np.asarray(by_name[g].data) for g in names]
                raw = np.concatenate(raws, axis=-2) if len(raws) > 1 else raws[0]  # [(E,) N, row bytes]
                heads = _permute_heads(cfg, hf_name)
                if heads:
                    raw = _rope_permute(raw, heads, inverse=True)
                order = qwen35.quantised_rows_order(cfg, hf_name) if hybrid else None
                if order is False:  # value heads reordered along the rows' length: not on quantised bytes
                    log.info("%s: %s dequantised: llama.cpp's value-head order moves its columns", source, spath)
                    quant = False
                    break
                if order is not None:
                    raw = raw[order]
                if k % cls.block_size:
                    raise GGUFError(f"{source}: tensor {names[0]}: row length {k} is not a multiple of the "
                                    f"{cls.name} block size {cls.block_size}")
                row_len = k // cls.block_size * cls.type_size // np.dtype(cls.storage_dtype).itemsize
                # numpy until the whole stack is built: one host -> device copy per target
                data = np.ascontiguousarray(raw).view(cls.storage_dtype).reshape(*hf_shape[:-2], n, row_len)
                per_layer.append(cls(data=data, shape=(k, n)))
            if quant and not row.per_layer:
                values[spath] = type(per_layer[0])(data=jnp.asarray(per_layer[0].data), shape=per_layer[0].shape)
                continue
            if quant and len(types) == 1:
                values[spath] = type(per_layer[0])(data=jnp.asarray(np.stack([w.data for w in per_layer])),
                                                   shape=per_layer[0].shape)
                continue
            if quant:  # per-layer types differ (llama.cpp's *_K_M mixes): one padded pytree, still quantised
                values[spath] = GGUFMixed.from_layers(per_layer)
                log.info("%s: %s has per-layer types %s (kept as gguf_mixed)", source, spath,
                         sorted(t.name for t in types))
                continue
        arrs = []
        for _, names, hf_name in items:
            parts = [_dequantize(by_name[g], source) for g in names]
            a = np.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]
            heads = _permute_heads(cfg, hf_name)
            if heads:
                a = _rope_permute(a, heads, inverse=True)
            if transforms:
                a = transforms.from_file(cfg, hf_name, a, names[0], source)
            arrs.append(np.swapaxes(a, -1, -2) if row.transpose else a)
        value = np.stack(arrs) if row.per_layer else arrs[0]
        values[spath] = jnp.asarray(value.astype(np_dtype))

    def fill(p, var):
        key = ".".join(map(str, p))
        if key not in values:
            return var
        v = values[key]
        if isinstance(v, QuantFormat):
            return QuantParam(v, **var.get_metadata())
        return var.replace(v)

    model = nnx.merge(graphdef, nnx.map_state(fill, abstract))
    return cfg, model, tokenizer


def _mtp_tensors(by_name: dict, cfg: ModelConfig, fields: dict) -> set[str]:
    """A qwen35 file's MTP layers (blk.N with N >= the model's layers, counted in nextn_predict_layers): skipped."""
    if not fields.get(f"{ARCHS[cfg.model_type]}.nextn_predict_layers"):
        return set()
    extra = {n for n in by_name if (m := re.match(r"blk\.(\d+)\.", n)) and int(m.group(1)) >= cfg.num_layers}
    if extra:
        log.info("%d MTP tensors (layers >= %d) skipped: surojax does not run multi-token prediction", len(extra),
                 cfg.num_layers)
    return extra


def _open(path) -> tuple[GGUFFile, dict, str]:
    gf = read_gguf_model(path)  # a split model's parts read as one (surojax.weights.gguf_split)
    return gf, gf.fields, str(gf.path)


def read_gguf_hf_config(path) -> dict:
    """The config.json dict of a GGUF file (metadata + the tensors that decide tied head / biases / rope)."""
    reader, fields, source = _open(path)
    return _hf_config(reader, fields, source)


def load_gguf_tokenizer(path):
    """The tokenizer of a GGUF file, rebuilt from its tokenizer.ggml.* metadata."""
    _, fields, source = _open(path)
    return tokenizer_from_fields(fields, source)


def is_gguf_path(p) -> bool:
    return p is not None and str(p).lower().endswith(".gguf")


__all__ = ["save_gguf", "encode_values", "load_gguf_model", "load_gguf_tokenizer", "read_gguf_hf_config", "hf_config_from_gguf",
           "gguf_name", "gguf_names", "is_gguf_path", "GGUF_NAMES", "GGUF_PARTS", "GGUFError"]
