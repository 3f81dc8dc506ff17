"""LoRA and QLoRA keys: adapter shape, target modules, stacked adapters, and how the frozen base is quantized."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from surojax.config.base import StrictModel

# HF module names LoRA can wrap on every family; "all-linear" means every Linear target the model has (never the LM
# head, as in PEFT): resolved against the model when LoRA is applied (surojax.models.targets.resolve_model_targets).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# MoE models only: the experts' fused gate|up projection, and both expert projections (down_proj names the experts'
# down projection on a MoE model; gate_proj + up_proj together mean gate_up_proj there). Checked against the model
# when LoRA is applied (surojax.peft.lora.resolve_targets). A MoE model with a shared expert (qwen2_moe) also:
# shared_expert (its three projections) or each by its PEFT module name.
MOE_LORA_TARGETS: tuple[str, ...] = ("gate_up_proj", "experts", "shared_expert", "shared_expert.gate_proj",
                                     "shared_expert.up_proj", "shared_expert.down_proj")
# Hybrid models (Qwen3.5) only: the Gated DeltaNet layers' projections (checked against the model when LoRA is applied).
LINEAR_ATTENTION_LORA_TARGETS: tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# the vision towers' module names (Qwen3-VL, Qwen3.5) a user may write as targets: the tower's adapters come from
# `train_vision: true` (surojax.peft.vision_lora), not from lora_target_modules
VISION_MODULE_NAMES = ("qkv", "attn.qkv", "proj", "attn.proj", "linear_fc1", "linear_fc2", "mlp.linear_fc1",
                       "mlp.linear_fc2", "merger", "visual")
GGUF_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
# llama.cpp file types that mix tensor types (surojax.quant.quantize_mix): one type per target when training
GGUF_MIXES = ("q3_k_m", "q4_k_m", "q5_k_m")
QloraFormat = Literal["nf4", "fp8", "nvfp4", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
                      "q6_k", "iq4_nl", "iq4_xs", "q3_k_m", "q4_k_m", "q5_k_m"]
# Surogate's four switches, accepted as spellings of one `qlora:` choice (a GGUF key names its type)
QLORA_SPELLINGS = {"qlora_bnb": "nf4", "qlora_fp8": "fp8", "qlora_fp4": "nvfp4", "qlora_gguf": None}


def spelled_formats(values: Mapping[str, Any]) -> set[str]:
    """The quantised-base formats that the qlora_* spellings set in `values` ask for."""
    return {fmt or str(values[key]).lower() for key, fmt in QLORA_SPELLINGS.items()
            if values.get(key) not in (None, False)}


GgufType = Literal["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
                   "q3_k_m", "q4_k_m", "q5_k_m"]


class LoraSection(StrictModel):
    lora: bool = False
    """Train LoRA adapters on a frozen base instead of all weights."""
    lora_rank: int = Field(default=16, gt=0)
    lora_alpha: float = Field(default=32.0, gt=0)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    use_rslora: bool = False
    """Scale by alpha / sqrt(rank) instead of alpha / rank."""
    lora_target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    """HF module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or "all-linear". On a MoE
    model: gate_up_proj (= gate_proj + up_proj, the experts' fused weight), down_proj (the experts'), experts (both);
    PEFT exports them as target_parameters mlp.experts.gate_up_proj / mlp.experts.down_proj. A shared expert
    (qwen2_moe): shared_expert (its gate/up/down projections) or shared_expert.gate_proj etc. one by one. A hybrid
    (Qwen3.5): also the Gated DeltaNet projections in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj.
    "all-linear" is every Linear target the model has (as PEFT's: attention, MLP or experts, a shared expert's
    projections, a hybrid's DeltaNet projections), resolved against the model."""
    lora_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the adapter weights."""
    train_router: bool = False
    """MoE: also train the (full) router weights alongside the adapters (a full fine-tune trains them anyway).
    The adapter folder then carries them as PEFT `modules_to_save`; a dense model refuses the key."""
    train_vision: bool = False
    """Vision-language models (Qwen3-VL, Qwen3.5): also train the vision tower and its patch mergers (Surogate's
    key), the way the run trains: full fine-tuning (lora: false) trains all their weights; with lora: true,
    LoRA adapters go on every Linear of the tower (each block's attn.qkv, attn.proj, mlp.linear_fc1 / fc2) and of
    the mergers (linear_fc1 / fc2, the deepstack mergers' too) with the run's rank / alpha / dropout, the tower's
    own weights frozen and the gradients flowing through it to the adapters (the patch embedding and positions stay
    frozen). Default: the tower is frozen, run in the compute dtype without gradients and kept out of the optimizer
    state; lora_target_modules names the language model's modules either way."""
    adapter_path: str | None = None
    """An existing PEFT adapter to start from (stacked LoRA)."""
    adapter_init_mode: Literal["merge", "trainable"] | None = None
    """merge (default when `adapter_path` is set): fold it into the base and train a new adapter on top;
    trainable: keep training it."""
    merge_adapter: bool = False
    """At the end, also save the base with the adapter merged in (HF safetensors)."""

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _targets(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [s.strip() for s in v.split(",") if s.strip()]
        if isinstance(v, (list, tuple)) and "all-linear" in v:
            if len(v) != 1:
                raise ValueError("'all-linear' cannot be combined with other module names")
            return ["all-linear"]
        if isinstance(v, (list, tuple)):
            bad = [m for m in v if m not in LORA_TARGETS + MOE_LORA_TARGETS + LINEAR_ATTENTION_LORA_TARGETS]
            tower = [m for m in bad if m in VISION_MODULE_NAMES or m.startswith(("visual.", "model.visual."))]
            if tower:
                raise ValueError(f"unknown module {tower[0]!r}: lora_target_modules names the language model's modules "
                                 f"({', '.join(LORA_TARGETS)} ... or 'all-linear'); {tower[0]!r} is a vision tower "
                                 "module: set train_vision: true to put adapters on every Linear of the tower and its "
                                 "mergers")
            if bad:
                raise ValueError(f"unknown module {bad[0]!r}; choose from {', '.join(LORA_TARGETS)} or 'all-linear' "
                                 f"(MoE models also: {', '.join(MOE_LORA_TARGETS)}; hybrid models also: "
                                 f"{', '.join(LINEAR_ATTENTION_LORA_TARGETS)})")
            if not v:
                raise ValueError("needs at least one module name (or 'all-linear')")
        return v


class QLoraSection(StrictModel):
    """The frozen base of LoRA quantised to one format: `qlora: nf4 | fp8 | nvfp4 | <GGUF type or mix>`, or
    Surogate's spellings `qlora_bnb: true` (nf4), `qlora_fp8: true`, `qlora_fp4: true` (nvfp4), `qlora_gguf: TYPE`.
    A single spelling fills `qlora`; several that disagree are a problem reported by rules.py."""

    qlora: QloraFormat | None = None
    """The quantised-base format (needs `lora: true`); see the qlora_* spellings below."""
    qlora_bnb: bool = False
    """Quantize the frozen base to NF4 (bitsandbytes-style)."""
    qlora_bnb_block_size: int = 64
    qlora_bnb_double_quant: bool = True
    """Quantize the NF4 absmax scales again (8-bit, blocks of 256)."""
    qlora_fp8: bool = False
    """Quantize the frozen base to FP8 E4M3 with per-block scales."""
    qlora_fp4: bool = False
    """Quantize the frozen base to NVFP4 (E2M1, E4M3 scale per 16 values)."""
    qlora_block_size: int = 128
    """Block size of the qlora_fp8 scales."""
    qlora_gguf: GgufType | None = None
    """Quantize the frozen base to this GGUF type, or to a llama.cpp mix (q3_k_m / q4_k_m / q5_k_m: per target the
    widest type llama.cpp's rule gives any of its layers). A .gguf `model` keeps its own quantization: leave this
    key unset."""

    @model_validator(mode="before")
    @classmethod
    def _one_choice(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        chosen = spelled_formats(data)
        if data.get("qlora") is None and len(chosen) == 1:
            return {**data, "qlora": chosen.pop()}
        return data

    @field_validator("qlora_bnb_block_size", "qlora_block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 16 or v & (v - 1):
            raise ValueError(f"must be a power of two >= 16 (got {v})")
        return v
