"""Quantise the frozen base of a built `Decoder`: the targeted Linear kernels of `model.layers` become quantised
weights (surojax.quant formats) in place, for LoRA over a quantised base (QLoRA).

    report = quantize_model(model, "nf4", double_quant=True)     # in place; returns a QuantReport
    apply_lora(model, rank=16, alpha=32, rngs=nnx.Rngs(0))        # the adapters on top, as on a plain base

What changes: the VALUE of each targeted `Linear.kernel` (a stacked [L, in, out] array) becomes the format's pytree
whose every leaf has the layers axis L first (each layer is quantised on its own, then the leaves are stacked), so
the decoder's `lax.scan` slices one layer's quantised weight exactly as it slices a plain kernel, and
`nnx.split` / `nnx.merge` / `jax.jit` / `jax.device_put` carry it like any other parameter pytree. The variable
stays an `nnx.Param` (the subclass `QuantParam`, which only lets `kernel[...]` return the packed pytree), with its
"axes" metadata, so LoRA's filters see it as frozen base (LoRA trains only `nnx.LoRAParam`). `Linear.__call__`
goes through `dot`, which calls the format's `matmul` (x @ dequantize(x.dtype) in the jnp reference path).

Embeddings, norms and the LM head are untouched. Folding a LoRA adapter into a quantised kernel (merge_lora,
stacked adapters in merge mode) raises `fold_into`'s error: merge into the unquantised model, then quantise.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.quant import FORMATS, quantize
from surojax.quant.base import QuantFormat

log = logging.getLogger(__name__)


class QuantParam(nnx.Param):
    """An `nnx.Param` whose value may be a quantised-weight pytree: `param[...]` returns that pytree whole
    (a plain `Variable` would index into it, which a dataclass pytree does not support)."""

    def __getitem__(self, key):
        value = self.get_value()
        if key is Ellipsis and isinstance(value, QuantFormat):
            return value
        return super().__getitem__(key)


def _nbytes(x) -> int:
    return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in jax.tree.leaves(x)))


@dataclasses.dataclass
class QuantReport:
    """Bytes of the targeted kernels before and after quantisation (per target name and in total)."""

    fmt: str
    before: dict[str, int] = dataclasses.field(default_factory=dict)
    after: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def bytes_before(self) -> int:
        return sum(self.before.values())

    @property
    def bytes_after(self) -> int:
        return sum(self.after.values())

    @property
    def ratio(self) -> float:
        return self.bytes_after / max(self.bytes_before, 1)

    def __str__(self) -> str:
        mib = 1024 ** 2
        return (f"quantised {len(self.before)} linear kernels to {self.fmt}: {self.bytes_before / mib:.2f} MiB -> "
                f"{self.bytes_after / mib:.2f} MiB ({self.ratio:.3f}x)")


def quantize_stacked(w, fmt: str, **options) -> QuantFormat:
    """A stacked kernel [L, K, N] (or a single [K, N]) -> the format's pytree, leaves [L, ...] (or unstacked)."""
    w = jnp.asarray(w)
    if w.ndim == 2:
        return quantize(np.asarray(w, np.float32), fmt, **options)
    if w.ndim != 3:
        raise ValueError(f"quantize_stacked expects [L, in, out] or [in, out], got shape {tuple(w.shape)}")
    per_layer = [quantize(np.asarray(w[i], np.float32), fmt, **options) for i in range(w.shape[0])]
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *per_layer)


def quantize_model(model, fmt: str, *, targets: str | Sequence[str] = "all-linear", **format_options) -> QuantReport:
    """Quantise the targeted Linear kernels of `model.layers` to `fmt` (a key of surojax.quant.FORMATS:
    nf4, fp8, nvfp4, q8_0, q4_0, ...), in place. `format_options` go to the format's `quantize`
    (e.g. double_quant=True for nf4). Works on a plain model or one already wrapped by LoRA (the base is
    quantised, the adapters stay). Returns a QuantReport (bytes before / after); also logged."""
    from surojax.models.registry import LINEAR_MODULES
    from surojax.peft.lora import base_linear, resolve_targets

    key = fmt.lower()
    if key not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(sorted(FORMATS))}")
    report = QuantReport(key)
    for name in resolve_targets(targets):
        lin = base_linear(model, name)
        var = lin.kernel
        if not isinstance(var, nnx.Variable):
            raise ValueError(f"{LINEAR_MODULES[name]}: kernel is not a Variable ({type(var).__name__})")
        value = var.get_value()
        if isinstance(value, QuantFormat):
            raise ValueError(f"{LINEAR_MODULES[name]}: the kernel is already quantised ({type(value).__name__})")
        try:
            q = quantize_stacked(value, key, **format_options)
        except ValueError as e:
            raise ValueError(f"{name} ({LINEAR_MODULES[name]}, kernel {tuple(value.shape)}): {e}") from None
        report.before[name] = _nbytes(value)
        report.after[name] = _nbytes(q)
        lin.kernel = QuantParam(q, **var.get_metadata())
    log.info("%s", report)
    return report


def dequantize_model(model, dtype=jnp.float32) -> None:
    """The inverse view, for tests and reference runs: every quantised kernel of `model.layers` becomes the plain
    `nnx.Param` holding its `dequantize(dtype)` (in place). The result computes x @ W exactly as the quantised
    model's jnp reference path does."""
    from surojax.models.registry import LINEAR_MODULES
    from surojax.peft.lora import base_linear

    for name in LINEAR_MODULES:
        lin = base_linear(model, name)
        value = lin.kernel.get_value()
        if isinstance(value, QuantFormat):
            lin.kernel = nnx.Param(value.dequantize(dtype), **lin.kernel.get_metadata())


def is_quantized(model) -> dict[str, str]:
    """Target name -> format name of every quantised base kernel of `model.layers`."""
    from surojax.models.registry import LINEAR_MODULES
    from surojax.peft.lora import base_linear

    out = {}
    for name in LINEAR_MODULES:
        value = base_linear(model, name).kernel.get_value()
        if isinstance(value, QuantFormat):
            out[name] = value.name
    return out


__all__ = ["QuantParam", "QuantReport", "quantize_model", "quantize_stacked", "dequantize_model", "is_quantized"]
