"""Quantise the kernel of one Linear in place: the value of its stacked [L, K, N] `kernel` becomes a format's
pytree (surojax.quant) whose every leaf has the layers axis L first (each layer quantised on its own, then the
leaves stacked), so the decoder's `lax.scan` slices one layer's quantised weight exactly as it slices a plain
kernel, and `nnx.split` / `nnx.merge` / `jax.jit` / `jax.device_put` carry it like any other parameter pytree.
The variable stays an `nnx.Param` (the subclass `QuantParam`, which only lets `kernel[...]` return the packed
pytree), with its "axes" metadata, so LoRA's filters see it as frozen base (LoRA trains only `nnx.LoRAParam`).
`Linear.__call__` goes through `dot`, which calls the format's `matmul`.

These are the per-Linear steps; which Linears of a model (the LoRA targets, under a LoRA wrapper or not) is the
caller's choice: surojax.quant.model.quantize_model applies them to a built Decoder.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.quant import quantize
from surojax.quant.base import QuantFormat


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
    """A stacked kernel [L, K, N] (a MoE layer's experts: [L, E, K, N]; or a single [K, N]) -> the format's pytree,
    leaves [L, ...] ([L, E, ...]; or unstacked). Each [K, N] matrix is quantised on its own."""
    w = jnp.asarray(w)
    if w.ndim == 2:
        return quantize(np.asarray(w, np.float32), fmt, **options)
    if w.ndim not in (3, 4):
        raise ValueError(f"quantize_stacked expects [L, in, out], [L, E, in, out] or [in, out], got shape "
                         f"{tuple(w.shape)}")
    lead = w.shape[:-2]
    flat = w.reshape(-1, *w.shape[-2:])
    per_matrix = [quantize(np.asarray(flat[i], np.float32), fmt, **options) for i in range(flat.shape[0])]
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]).reshape(*lead, *jnp.shape(xs[0])),
                        *per_matrix)


def quantize_kernel(linear: nnx.Module, fmt: str, **format_options) -> tuple[int, int]:
    """Quantise `linear.kernel` ([L, K, N], an ExpertLinear's [L, E, K, N], or [K, N]) to `fmt` in place (a QuantParam with the same metadata);
    -> (bytes before, bytes after). ValueError when the kernel is not a Variable, is already quantised, or the
    format refuses its shape."""
    var = linear.kernel
    if not isinstance(var, nnx.Variable):
        raise ValueError(f"kernel is not a Variable ({type(var).__name__})")
    value = var.get_value()
    if isinstance(value, QuantFormat):
        raise ValueError(f"the kernel is already quantised ({type(value).__name__})")
    try:
        q = quantize_stacked(value, fmt, **format_options)
    except ValueError as e:
        raise ValueError(f"kernel {tuple(value.shape)}: {e}") from None
    linear.kernel = QuantParam(q, **var.get_metadata())
    return _nbytes(value), _nbytes(q)


def dequantize_kernel(linear: nnx.Module, dtype=jnp.float32) -> None:
    """A quantised `linear.kernel` becomes the plain `nnx.Param` holding its `dequantize(dtype)` (in place; a plain
    kernel is left as is)."""
    value = linear.kernel.get_value()
    if isinstance(value, QuantFormat):
        linear.kernel = nnx.Param(value.dequantize(dtype), **linear.kernel.get_metadata())


def kernel_format(linear: nnx.Module) -> str | None:
    """The format name of a quantised `linear.kernel`, None for a plain one."""
    value = linear.kernel.get_value()
    return value.name if isinstance(value, QuantFormat) else None


__all__ = ["QuantParam", "QuantReport", "dequantize_kernel", "kernel_format", "quantize_kernel", "quantize_stacked"]
