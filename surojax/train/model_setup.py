"""From a TrainConfig to the model the trainer trains: load or build, precision, LoRA.

Precision recipes (`recipe`):
    fp32  everything fp32 (exact CPU tests)
    bf16  bf16 compute (matmul operands), fp32 accumulation. Full fine-tuning keeps fp32 master weights
          (`master_dtype`) that are cast at each use; LoRA keeps the frozen base in bf16 and the adapters in
          `lora_dtype` (fp32 by default).
    fp8_hybrid  bf16 as above, and the decoder's Linear layers multiply in FP8 (E4M3 forward, E5M2 gradients,
          per-tensor scaling; surojax.precision): a LoRA base is quantised once, full fine-tuning quantises the
          weights at every use. `skip_quant_first_layers` / `skip_quant_last_layers` keep layers in bf16.
Transforms are applied to the built model in this order: (quantise base) -> LoRA (stacked adapters first) -> fp8.
`model: path/to/file.gguf` loads a llama.cpp GGUF as the base, its quantised kernels kept in their GGUF format
(surojax.weights.gguf_checkpoint); the architecture comes from its metadata.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder

log = logging.getLogger(__name__)

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


class TrainSetupError(ValueError):
    is_user_error = True


@dataclasses.dataclass(frozen=True)
class Precision:
    compute: object  # activation / matmul operand dtype
    base: object  # storage of frozen (LoRA) or master (full) weights
    adapter: object  # storage of LoRA adapters


def precision_for(cfg) -> Precision:
    if cfg.recipe not in ("fp32", "bf16", "fp8_hybrid"):
        raise TrainSetupError(f"recipe: {cfg.recipe} is not available yet in this version (use bf16, fp32 or "
                              "fp8_hybrid)")
    if cfg.recipe == "fp32":
        return Precision(jnp.float32, jnp.float32, jnp.float32)
    base = jnp.bfloat16 if cfg.lora else DTYPES[cfg.master_dtype]
    return Precision(jnp.bfloat16, base, DTYPES[cfg.lora_dtype])


def model_config_for(cfg) -> ModelConfig:
    """The architecture: the model folder's config.json, updated by `model_config` (from_scratch)."""
    from surojax.data.hub import resolve_local

    hf: dict = {}
    if cfg.model and is_gguf_path(cfg.model):
        hf = gguf_hf_config(cfg.model)
    elif cfg.model:
        path = Path(resolve_local(cfg.model)) / "config.json"
        if not path.is_file():
            raise TrainSetupError(f"model: {cfg.model} has no config.json")
        hf = json.loads(path.read_text())
    hf.update(cfg.model_config_overrides or {})
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(cfg.rope_scaling)
        hf.pop("rope_parameters", None)
    if cfg.max_model_len:
        hf["max_position_embeddings"] = cfg.max_model_len
    try:
        return ModelConfig.from_hf(hf)
    except ValueError as e:
        raise TrainSetupError(f"model_config: {e}") from None


def qlora_format(cfg) -> tuple[str, dict] | None:
    """The quantised-base format asked by the qlora_* keys: (surojax.quant format name, quantize options), or
    None. Raises TrainSetupError for what cannot be done (yet)."""
    from surojax.quant import GGUF_TYPES

    opt = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731 (bench namespaces lack these keys)
    if opt("qlora_bnb"):
        if opt("qlora_bnb_block_size", 64) != 64:
            raise TrainSetupError(f"qlora_bnb_block_size: {cfg.qlora_bnb_block_size} is not available; NF4 uses the "
                                  "bitsandbytes block size 64")
        fmt, options = "nf4", {"double_quant": bool(opt("qlora_bnb_double_quant", True))}
    elif opt("qlora_fp8"):
        if opt("qlora_block_size", 128) != 128:
            raise TrainSetupError(f"qlora_block_size: {cfg.qlora_block_size} is not available; FP8 uses 128 x 128 "
                                  "scale blocks")
        fmt, options = "fp8", {}
    elif opt("qlora_fp4"):
        fmt, options = "nvfp4", {}
    elif opt("qlora_gguf"):
        from surojax.config.lora import GGUF_MIXES

        fmt, options = opt("qlora_gguf").lower(), {}
        cls = GGUF_TYPES.get(fmt)
        if fmt in GGUF_MIXES:
            pass  # quantised per target by surojax.quant.quantize_mix
        elif cls is None or not cls.can_quantize:
            from surojax.config.lora import GGUF_TYPES as CONFIG_GGUF

            ok = [t for t in CONFIG_GGUF if t in GGUF_TYPES and GGUF_TYPES[t].can_quantize]
            raise TrainSetupError(f"qlora_gguf: {cfg.qlora_gguf} cannot be quantised to yet (no quantiser for it in "
                                  f"this version); types that work: {', '.join(ok)}")
    else:
        return None
    if is_gguf_path(opt("model")):
        raise TrainSetupError(f"qlora_*: model: {cfg.model} is a GGUF file, which keeps its own quantization; "
                              "remove the qlora_* key (or start from the HF model folder)")
    if not cfg.lora:
        raise TrainSetupError("qlora_* quantizes the frozen base for LoRA; full fine-tuning over a quantized base is "
                              "not possible: set lora: true")
    if opt("merge_adapter"):
        raise TrainSetupError("merge_adapter cannot fold the adapter into a quantized base; train without it, then "
                              "merge the saved adapter into the unquantized model")
    if opt("adapter_path") and (opt("adapter_init_mode") or "merge") == "merge":
        raise TrainSetupError("adapter_init_mode: merge cannot fold the adapter into a quantized base; use "
                              "adapter_init_mode: trainable, or merge it into the unquantized model first")
    return fmt, options


def build_model(cfg, *, attention: str | None = None) -> Decoder:
    """Load (or randomly initialise with `from_scratch`) and apply the LoRA transform when asked. attention:
    the backend (default cfg.attention; the Trainer passes `attention.packed_backend` of its data)."""
    from surojax.weights.hf_checkpoint import load_model

    prec = precision_for(cfg)
    qlora = qlora_format(cfg)  # checked before any weight is loaded
    mcfg = model_config_for(cfg)
    attention = attention or cfg.attention
    if cfg.from_scratch:
        model = Decoder(mcfg, dtype=prec.compute, param_dtype=prec.base, attention=attention,
                        rngs=nnx.Rngs(params=cfg.seed))
        log.info("initialised %s from scratch (seed %d)", mcfg.model_type, cfg.seed)
    elif is_gguf_path(cfg.model):
        model = load_gguf_base(cfg, prec, mcfg, attention)
    else:
        model = load_model(cfg.model, dtype=prec.compute, param_dtype=prec.base, attention=attention, cfg=mcfg)
    if qlora is not None:
        from surojax.config.lora import GGUF_MIXES
        from surojax.peft.qlora import quantize_model, quantize_model_mix

        fmt, options = qlora
        try:
            if fmt in GGUF_MIXES:
                log.info("quantised the base as llama.cpp %s: %s", fmt, quantize_model_mix(model, fmt))
            else:
                log.info("%s", quantize_model(model, fmt, **options))
        except ValueError as e:
            raise TrainSetupError(f"quantising the base to {fmt}: {e}") from None
    if cfg.lora:
        from surojax.peft.stacked import init_lora

        init_lora(model, targets=cfg.lora_target_modules, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                  dropout=cfg.lora_dropout, use_rslora=cfg.use_rslora, rngs=nnx.Rngs(params=cfg.seed + 1),
                  dtype=prec.adapter, adapter_path=cfg.adapter_path, adapter_init_mode=cfg.adapter_init_mode)
    if cfg.recipe == "fp8_hybrid":
        apply_fp8_recipe(cfg, model, prec)
    return model


def apply_fp8_recipe(cfg, model: Decoder, prec: Precision) -> None:
    """recipe: fp8_hybrid: the decoder's Linear layers multiply in FP8 (surojax.precision.fp8_transform)."""
    from surojax.precision.fp8_transform import apply_fp8

    opt = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731 (bench namespaces lack these keys)
    if cfg.lora and opt("merge_adapter"):
        raise TrainSetupError("recipe: fp8_hybrid quantises the frozen base to FP8, so merge_adapter would fold the "
                              "adapter into the FP8 values; train without it, then merge the saved adapter into the "
                              "bf16 model (surojax merge)")
    try:
        targets = apply_fp8(model, frozen_base=bool(cfg.lora), skip_first=opt("skip_quant_first_layers", 0),
                            skip_last=opt("skip_quant_last_layers", 0), compute_dtype=prec.compute)
    except ValueError as e:
        raise TrainSetupError(f"recipe: fp8_hybrid: {e}") from None
    log.info("fp8_hybrid: %d linear targets multiply in FP8 (%s base)", len(targets),
             "frozen E4M3" if cfg.lora else "trainable")
    _warn_experimental()
    if not has_fp8_tensor_cores():
        _warn_no_fp8(jax.devices()[0].device_kind)


@functools.lru_cache(maxsize=None)
def _warn_experimental() -> None:
    from surojax.precision.fp8_matmul import dot_form

    log.warning("fp8_hybrid is EXPERIMENTAL: on the last H200 check (jax 0.11.2) its GEMMs did not run in FP8 "
                "(the qdq form was compiled to bf16 GEMMs without the activation rounding, slower than recipe: "
                "bf16); this build writes them as direct FP8 dots (SUROJAX_FP8_DOT=%s), not yet measured on the "
                "GPU. Check with `python benchmarks/fp8_gemm_check.py` before relying on it (docs/precision.md)",
                dot_form())


@functools.lru_cache(maxsize=None)  # once per device kind (a model may be built twice: shapes, then values)
def _warn_no_fp8(kind: str) -> None:
    log.warning("fp8_hybrid: %s has no FP8 tensor cores (needs compute capability >= 8.9, e.g. H100 / H200): the "
                "GEMMs run in bf16 after the FP8 rounding, slower than recipe: bf16", kind)


def has_fp8_tensor_cores() -> bool:
    """Whether the default device runs FP8 GEMMs (NVIDIA Ada / Hopper or newer)."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cc is not None and tuple(int(v) for v in str(cc).split(".")[:2]) >= (8, 9)
    except ValueError:
        return False


def is_gguf_path(p) -> bool:
    return p is not None and str(p).lower().endswith(".gguf")


def gguf_hf_config(path) -> dict:
    """The config.json-style dict of a .gguf `model` (from its metadata)."""
    from surojax.weights.gguf_checkpoint import read_gguf_hf_config

    return read_gguf_hf_config(path)


def load_gguf_base(cfg, prec: Precision, mcfg: ModelConfig, attention: str | None = None) -> Decoder:
    """`model: file.gguf`: the base with its quantised Linear kernels kept in their GGUF format (LoRA only)."""
    from surojax.peft.qlora import is_quantized
    from surojax.weights.gguf_checkpoint import load_gguf_model

    _, model, _ = load_gguf_model(cfg.model, dtype=prec.compute, param_dtype=prec.base,
                                  attention=attention or cfg.attention,
                                  cfg=mcfg, keep_quantized=True)
    quantized = is_quantized(model)
    if quantized and not cfg.lora:
        kinds = ", ".join(sorted(set(quantized.values())))
        raise TrainSetupError(f"model: {cfg.model} holds quantized weights ({kinds}); full fine-tuning over a "
                              "quantized base is not possible: set lora: true")
    if quantized and getattr(cfg, "merge_adapter", False):
        raise TrainSetupError("merge_adapter cannot fold the adapter into a quantized GGUF base; train without it, "
                              "then merge the saved adapter into the unquantized HF model")
    log.info("loaded GGUF base %s (quantized kernels: %s)", cfg.model, quantized or "none")
    return model


def trainable_filter(cfg):
    """What the optimizer updates: the adapters for LoRA, every weight otherwise."""
    if cfg.lora:
        from surojax.peft.lora import TRAINABLE

        return TRAINABLE
    return nnx.Param
