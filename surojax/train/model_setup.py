"""From a RunSpec to the model a run trains: load or build, then the transforms, applied from outside the model.

Transforms are applied to the built model in this order: quantise the base (QLoRA) -> LoRA (stacked adapters
first) -> fp8 (recipe fp8_hybrid) or nvfp4 (recipe nvfp4). A `.gguf` model source keeps its quantised kernels in
their GGUF format (surojax.weights.gguf_checkpoint); its architecture comes from its metadata
(run_spec.hf_config_of). A pre-quantised HF checkpoint keeps its kernels in the surojax format that holds them
(surojax.weights.prequant); `qlora:` over it must name that format (run_spec.quant_spec).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
from flax import nnx

from surojax.hub import model_path
from surojax.models.decoder import Decoder
from surojax.peft.lora import TRAINABLE, set_dropout_key
from surojax.peft.stacked import init_lora
from surojax.precision.fp8_delayed import DelayedScalingUpdate, Fp8AmaxProbe, Fp8DelayedState
from surojax.precision.fp8_matmul import dot_form
from surojax.precision.fp8_transform import CACHED_SCALINGS, Fp8WeightCaching, apply_fp8
from surojax.precision.nvfp4_transform import apply_nvfp4, bf16_layers, set_rounding_keys
from surojax.quant.model import is_quantized, quantize_model, quantize_model_mix
from surojax.train.run_spec import RunSpec, TrainSetupError
from surojax.model_loader import load_base
from surojax.weights.model_ref import resolve_model

log = logging.getLogger(__name__)


def build_model(spec: RunSpec, *, shardings_of: Callable[[nnx.State], nnx.State] | None = None) -> Decoder:
    """The model of `spec`: loaded from `spec.model.source` (or initialised from its seed), then transformed.
    shardings_of: a loaded HF base made straight into these shardings (`load_base_model`)."""
    m, prec = spec.model, spec.precision
    if m.source is None:
        model = Decoder(m.config, dtype=prec.compute, param_dtype=prec.base, attention=m.attention,
                        rngs=nnx.Rngs(params=m.seed))
        log.info("initialised %s from scratch (seed %d)", m.config.model_type, m.seed)
    else:
        model = load_base_model(spec, shardings_of=shardings_of)
    if spec.quant is not None:
        try:
            if spec.quant.is_mix:
                log.info("quantised the base as llama.cpp %s: %s", spec.quant.format,
                         quantize_model_mix(model, spec.quant.format))
            else:
                log.info("%s", quantize_model(model, spec.quant.format, **dict(spec.quant.options)))
        except ValueError as e:
            raise TrainSetupError(f"quantising the base to {spec.quant.format}: {e}") from None
    if spec.lora is not None:
        lo, a = spec.lora, spec.lora.adapter
        init_lora(model, targets=a.targets, rank=a.rank, alpha=a.alpha, dropout=a.dropout,
                  use_rslora=a.use_rslora, rngs=nnx.Rngs(params=m.seed + 1), dtype=prec.adapter,
                  adapter_path=model_path(lo.adapter_path) if lo.adapter_path else None,  # a folder or a Hub id
                  adapter_init_mode=lo.adapter_init_mode)
    if prec.recipe == "fp8_hybrid":
        apply_fp8_recipe(spec, model)
    elif prec.recipe == "nvfp4":
        apply_nvfp4_recipe(spec, model)
    return model


def apply_nvfp4_recipe(spec: RunSpec, model: Decoder) -> None:
    """recipe: nvfp4: the decoder's Linear layers run the NVFP4 recipe (surojax.precision.nvfp4_transform), the RHT
    signs and first rounding keys from the run's seed. The config check refuses qlora_* bases and merge_adapter."""
    prec, L = spec.precision, spec.model.config.num_layers
    try:
        targets = apply_nvfp4(model, frozen_base=spec.lora is not None, seed=spec.model.seed,
                              skip_first=prec.skip_first_layers, skip_last=prec.skip_last_layers)
    except ValueError as e:
        raise TrainSetupError(f"recipe: nvfp4: {e}") from None
    first, last = bf16_layers(L, prec.skip_first_layers, prec.skip_last_layers)
    log.info("nvfp4: %d linear targets run NVFP4 GEMMs (emulated: bf16 GEMMs on exactly quantised operands) in %d "
             "of %d layers; the first %d and last %d stay bf16", len(targets), L - first - last, L, first, last)


def apply_fp8_recipe(spec: RunSpec, model: Decoder) -> None:
    """recipe: fp8_hybrid: the decoder's Linear layers multiply in FP8 (surojax.precision.fp8_transform). The
    config check refuses merge_adapter with it (the adapter would be folded into FP8 values)."""
    lora, prec = spec.lora is not None, spec.precision
    try:
        targets = apply_fp8(model, frozen_base=lora, skip_first=prec.skip_first_layers,
                            skip_last=prec.skip_last_layers, compute_dtype=prec.compute, settings=prec.fp8)
    except ValueError as e:
        raise TrainSetupError(f"recipe: fp8_hybrid: {e}") from None
    log.info("fp8_hybrid: %d linear targets multiply in FP8 (%s base, %s scaling, %s GEMMs: SUROJAX_FP8_DOT)",
             len(targets), "frozen E4M3" if lora else "trainable", prec.fp8.scaling, dot_form())
    if not has_fp8_tensor_cores():
        _warn_no_fp8(jax.devices()[0].device_kind)


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


def load_base_model(spec: RunSpec, *, shardings_of: Callable[[nnx.State], nnx.State] | None = None) -> Decoder:
    """The weights of `spec.model.source` through the one model loader; a .gguf base, and a pre-quantised HF
    checkpoint (FP8, NVFP4, bitsandbytes NF4: surojax.weights.prequant), keep their quantised Linear kernels in
    their format (LoRA only); published MXFP4 experts stay packed or are dequantised as `spec.model.packed_experts`
    decided (the start-up summary's `base` line). shardings_of: an HF base's parameters made straight into these
    shardings, each process reading its part (surojax.weights.hf_checkpoint.load_model)."""
    m = spec.model
    keep = m.packed_experts.keep if m.packed_experts is not None else True
    model, _ = load_base(resolve_model(m.source), dtype=spec.precision.compute, param_dtype=spec.precision.base,
                         attention=m.attention, cfg=m.config, keep_quantized=keep, shardings_of=shardings_of)
    quantized = is_quantized(model)
    if quantized and spec.lora is None:
        kinds = ", ".join(sorted(set(quantized.values())))
        raise TrainSetupError(f"model: {m.source} holds quantized weights ({kinds}); full fine-tuning over a "
                              "quantized base is not possible: set lora: true")
    if quantized and spec.lora.merge_adapter:
        kinds = ", ".join(sorted(set(quantized.values())))
        raise TrainSetupError(f"merge_adapter cannot fold the adapter into a quantized base ({kinds}); train "
                              "without it, then merge the saved adapter into the unquantized HF model")
    if m.is_gguf:
        log.info("loaded GGUF base %s (quantized kernels: %s)", m.source, quantized or "none")
    return model


def step_prepare(spec: RunSpec, *, dropout: bool) -> Callable | None:
    """What the training step runs on the model before each micro-batch (`make_train_step(prepare=...)`) with a key
    distinct per step and micro-batch: LoRA dropout keys (`dropout`), the nvfp4 recipe's stochastic-rounding keys
    (from an independent stream); None when neither applies."""
    nvfp4 = spec.precision.recipe == "nvfp4"
    if not (dropout or nvfp4):
        return None

    def prepare(model, key):
        if dropout:
            set_dropout_key(model, key)
        if nvfp4:
            set_rounding_keys(model, jax.random.fold_in(key, 1))
    return prepare


def trainable_filter(spec: RunSpec):
    """What the step updates: the adapters for LoRA, every weight otherwise; with fp8_scaling: delayed also the
    FP8 amax probes and histories (the step rolls them; the optimizer never sees them: fp8_delayed_update)."""
    params = TRAINABLE if spec.lora is not None else nnx.Param
    if fp8_delayed_update(spec) is None:
        return params
    return nnx.Any(params, Fp8AmaxProbe, Fp8DelayedState)


def fp8_delayed_update(spec: RunSpec) -> DelayedScalingUpdate | None:
    """The step's delayed-scaling update (recipe fp8_hybrid with fp8_scaling: delayed), else None."""
    prec = spec.precision
    if prec.recipe != "fp8_hybrid" or prec.fp8.scaling != "delayed":
        return None
    return DelayedScalingUpdate(algo=prec.fp8.amax_compute_algo)


def fp8_weight_cache(spec: RunSpec) -> Fp8WeightCaching | None:
    """The step's FP8 weight cache (recipe fp8_hybrid, full fine-tuning, fp8_scaling current or delayed: each
    trainable kernel quantised once per step), else None."""
    prec = spec.precision
    if prec.recipe != "fp8_hybrid" or prec.fp8.scaling not in CACHED_SCALINGS or spec.lora is not None:
        return None
    return Fp8WeightCaching()
