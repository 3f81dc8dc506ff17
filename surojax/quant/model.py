"""Quantisation as a transform of a built `Decoder` (QLoRA's frozen base, serving's quantised weights): quantise
(or dequantise, or list) the targeted Linear kernels, whether or not a wrapper (LoRA) already holds them as its
`base` (surojax.models.targets.base_linear).

    report = quantize_model(model, "nf4", double_quant=True)     # in place; returns a QuantReport
    apply_lora(model, rank=16, alpha=32, rngs=nnx.Rngs(0))        # the adapters on top, as on a plain base

Each targeted kernel becomes a format's stacked pytree in a `QuantParam` (surojax.quant.transform: one Linear at a
time); on a MoE model the targets are q/k/v/o_proj and the experts' stacked [L, E, K, N] kernels (each expert
quantised on its own, leaves [L, E, ...], run by the format's `grouped_matmul`); embeddings, norms, the MoE router
and the LM head are untouched. Folding a LoRA adapter into a quantised kernel
(merge_lora, stacked adapters in merge mode) raises `fold_into`'s error: merge into the unquantised model, then
quantise. The formats and the per-Linear step (surojax.quant.transform) know nothing of LoRA; this module finds the
targets through surojax.models.targets.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import jax.numpy as jnp

from surojax.models.targets import TARGET_PATHS, base_linear, model_targets, resolve_model_targets, target_name
from surojax.quant import FORMATS
from surojax.quant.transform import QuantReport, dequantize_kernel, kernel_format, quantize_kernel

log = logging.getLogger(__name__)


def quantize_model(model, fmt: str, *, targets: str | Sequence[str] = "all-linear", **format_options) -> QuantReport:
    """Quantise the targeted Linear kernels of `model.layers` to `fmt` (a key of surojax.quant.FORMATS:
    nf4, fp8, nvfp4, q8_0, q4_0, ...), in place. `format_options` go to the format's `quantize`
    (e.g. double_quant=True for nf4). Works on a plain model or one already wrapped by LoRA (the base is
    quantised, the adapters stay). Returns a QuantReport (bytes before / after); also logged."""
    key = fmt.lower()
    if key not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(sorted(FORMATS))}")
    return _quantize_sites(model, key, resolve_model_targets(model, targets), **format_options)


def _quantize_sites(model, key: str, sites, **format_options) -> QuantReport:
    """Quantise the base kernels of the target `sites` (site keys, surojax.models.targets) to format `key`."""
    report = QuantReport(key)
    for name in sites:
        try:
            report.before[name], report.after[name] = quantize_kernel(base_linear(model, name), key, **format_options)
        except ValueError as e:
            raise ValueError(f"{name} ({TARGET_PATHS[target_name(name)]}): {e}") from None
    log.info("%s", report)
    return report


def quantize_model_mix(model, file_type: str, targets: str | Sequence[str] = "all-linear") -> dict[str, str]:
    """Quantise the targeted base kernels of `model` as a llama.cpp file type would (`qlora_gguf: q4_k_m`), one
    format per target (`quantize_mix.uniform_target_types`). In place; returns target -> format."""
    # lazy: quantize_mix needs the optional `gguf` package (absent from the GPU image), quantize_model does not
    from surojax.quant.quantize_mix import uniform_target_types

    names = resolve_model_targets(model, targets)
    if model.cfg.linear_attention is not None or getattr(model.cfg, "short_conv", None) is not None:
        kind = "Gated DeltaNet" if model.cfg.linear_attention is not None else "short-convolution"
        raise ValueError(f"a llama.cpp file type's per-tensor mix ({file_type}) is not defined for a hybrid "
                         f"({model.cfg.model_type}: {kind} layers) yet; quantise the base to one format "
                         "(qlora: q4_k, q8_0, nf4, fp8, ...)")
    chosen = uniform_target_types(file_type, model.cfg, names)
    for name in names:
        _quantize_sites(model, chosen[name].lower(), [name])
    return chosen


def dequantize_model(model, dtype=jnp.float32) -> None:
    """The inverse view, for tests and reference runs: every quantised kernel of `model.layers` becomes the plain
    `nnx.Param` holding its `dequantize(dtype)` (in place). The result computes x @ W exactly as the quantised
    model's jnp reference path does."""
    for name in model_targets(model):
        dequantize_kernel(base_linear(model, name), dtype)


def is_quantized(model) -> dict[str, str]:
    """Target name -> format name of every quantised base kernel of `model.layers`."""
    formats = {name: kernel_format(base_linear(model, name)) for name in model_targets(model)}
    return {name: fmt for name, fmt in formats.items() if fmt is not None}


class QuantizedBase:
    """QLoRA's frozen base as a run's transform (surojax.models.transform): the targeted base kernels quantised to
    `fmt` (a surojax.quant format, `options` to its `quantize`) or as a llama.cpp file type (`quantize_model_mix`).
    Nothing new trains and no step hook; its memory-plan term: the kernels' bytes per value (a mix: none, the
    plan keeps the base dtype)."""

    name = "quantized_base"
    freezes_base = False
    trainable = None
    hooks = None

    def __init__(self, fmt: str, options: dict | None = None, *, mix: bool = False):
        self.format, self.options, self.mix = fmt, dict(options or {}), mix
        self.report: str | None = None

    def apply(self, model) -> None:
        """Raises ValueError naming the format for what cannot be quantised."""
        try:
            if self.mix:
                self.report = f"llama.cpp {self.format}: {quantize_model_mix(model, self.format)}"
            else:
                self.report = str(quantize_model(model, self.format, **self.options))
        except ValueError as e:
            raise ValueError(f"quantising the base to {self.format}: {e}") from None
        log.info("quantised the base: %s", self.report)

    @property
    def memory(self) -> dict:
        return {} if self.mix else {"kernel_weight_bytes": FORMATS[self.format].bytes_per_value()}

    def summary(self) -> str:
        return self.report or f"the frozen base quantised to {self.format}"


__all__ = ["QuantizedBase", "dequantize_model", "is_quantized", "quantize_model", "quantize_model_mix"]
