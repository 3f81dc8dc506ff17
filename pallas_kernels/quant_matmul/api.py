"""`quant_matmul(x, w)`: the matmul of every quantised weight (a format's `matmul` calls it), choosing between

    pallas  the fused dequantise + matmul kernels (quant_matmul.kernel) under a custom_vjp: forward y = x @ W,
            backward dx = g @ W^T by the transposed kernel, no gradient for the frozen W (zero cotangents)
    xla     x @ w.dequantize(x.dtype): XLA dequantises the weight into a bf16 temporary and runs its GEMM; a
            custom_vjp dequantises again in the backward for dx = g @ W^T (no bf16 copy kept as a residual)

The choice is the caller's `mode` = auto | pallas | xla (default auto; surojax passes its kernel settings'
quant_matmul, SUROJAX_QUANT_MATMUL: surojax/kernel_settings.py; this package reads no environment).
auto = xla off GPU, and on GPU pallas only for the formats listed in AUTO_PALLAS (the ones whose fused kernel
benchmarks/quant_matmul_h200.py found faster than dequantise-then-matmul: benchmarks/RESULTS.md), xla for the
rest. pallas forces the kernels (interpret mode off GPU: slow, for tests) and raises when a weight cannot
take them (a format without a kernel, stacked leaves, K or N off the tiles); auto falls back to xla instead.

Decode. With M <= DECODE_ROWS rows (one token per running sequence) the kernel runs in its decode form: a
16-row tile, K split over programs (kernel.splits_for) so that the weight is read by enough SMs. auto takes it
on GPU for a weight already in the kernel layout (`layout_is_free`: surojax.quant.laid_out, which a served model
is converted to at load) when M <= DECODE_MAX_M[layout name], the crossover benchmarks/quant_matmul_h200.py
--decode measured against XLA (dequantise-then-GEMV, or the plain GEMV for a bf16 weight). `decode_layouts()`
says which layouts a server should convert.

The weight is any pytree that has the `PackedWeight` methods (surojax.quant's formats do): the api never needs
its class, only its dequantize (the xla path) and its KernelLayout (the kernels). The weight itself, not its
layout, is the custom_vjps' residual: under a scan that is the scanned slice, nothing new is saved per layer.
The kernels see one layer's weight: the decoder's lax.scan slices the stacked [L, ...] leaves before the call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul.kernel import Tiles, forward, splits_for, transposed
from pallas_kernels.quant_matmul.layout import PLAIN, KernelLayout, LayoutSpec


class PackedWeight(Protocol):
    """What quant_matmul needs of a quantised [K, N] weight (a JAX pytree of its packed arrays)."""

    @property
    def kernel_spec(self) -> LayoutSpec | None:
        """How the kernels decode this format; None: no fused kernel."""

    def dequantize(self, dtype) -> jax.Array:
        """-> [K, N] in dtype (pure jnp)."""

    def kernel_layout_error(self, kt: int) -> str | None:
        """Why this weight cannot take the kernels with K tile kt (None: it can)."""

    def kernel_layout(self, kt: int) -> KernelLayout:
        """The weight's KernelLayout with K tile kt (jnp, jit-able)."""


MODES = ("auto", "pallas", "xla")

# Formats whose fused kernel beats XLA's dequantise-then-matmul (forward + input gradient) in
# benchmarks/quant_matmul_h200.py. Empty: XLA won for every format benchmarked (benchmarks/RESULTS.md#quant-bases).
AUTO_PALLAS: frozenset[str] = frozenset()

# Tiles (forward, transposed) of every format, unless TUNED_TILES (keyed by LayoutSpec.name) has its own. The
# benchmark prints its best configurations per format.
DEFAULT_TILES: tuple[Tiles, Tiles] = (Tiles(bm=128, bn=128, kt=128, num_warps=8, num_stages=3),
                                      Tiles(bm=128, bn=64, kt=128, num_warps=8, num_stages=3))
TUNED_TILES: dict[str, tuple[Tiles, Tiles]] = {}


def tiles_for(spec: LayoutSpec) -> tuple[Tiles, Tiles]:
    """(forward, transposed) tiles of a format."""
    return TUNED_TILES.get(spec.name, DEFAULT_TILES)


# The decode form: M <= DECODE_ROWS rows, one 16-row tile, K split (kernel.splits_for). DECODE_MAX_M maps a layout
# name (a format's LayoutSpec.name, or "bfloat16" for a plain weight) to the largest M at which auto takes the
# kernel; a layout not listed stays on XLA at every M. Filled from benchmarks/quant_matmul_h200.py --decode.
DECODE_ROWS = 64
# Per Qwen3-8B layer (benchmarks/RESULTS.md#s11) the kernel beat XLA at every M measured (1-64) for q4_k, q8_0
# and fp8, for nf4 up to 16 (not at 32), for q6_k and nvfp4 at 1-8 (larger M not measured); bf16 barely at M = 1
# and not above: left on XLA.
DECODE_MAX_M: dict[str, int] = {"q4_k": 64, "q8_0": 64, "fp8": 64, "nf4": 16, "q6_k": 8, "nvfp4": 8}
# ... and only for weights of at least this many values (K x N). Session 11 set 4096 x 1024: a whole Qwen3-0.6B
# decode step (linears of 1-3M values) was then slower through the kernel (a pad and a partial-sum kernel each).
# Measured again on an H100 on 2026-12-07 (benchmarks/RESULTS.md#s25, same job, SUROJAX_QUANT_MATMUL=pallas
# against auto with that threshold, i.e. XLA): Qwen3-0.6B all-Q4_K decodes 1.15x faster at 1 user and 1.45x at
# 16 through the kernel (XLA's dequantise-then-reduce was 1,114 kernels a token). So the threshold is the
# smallest linear measured (1024 x 1024, Qwen3-0.6B's k / v); smaller weights stay on XLA (unmeasured).
DECODE_MIN_VALUES = 1024 * 1024
DECODE_TILES = Tiles(bm=64, bn=64, kt=128, num_warps=4, num_stages=4)  # bm shrinks to M's power of 2 (>= 16)
TUNED_DECODE_TILES: dict[str, Tiles] = {  # the sweep's best at M = 1 where it differs from DECODE_TILES
    "q8_0": Tiles(bm=64, bn=64, kt=128, num_warps=4, num_stages=3),
    "nf4": Tiles(bm=64, bn=32, kt=128, num_warps=4, num_stages=3),
    "fp8": Tiles(bm=64, bn=128, kt=128, num_warps=8, num_stages=4),
    "bfloat16": Tiles(bm=64, bn=32, kt=128, num_warps=4, num_stages=3),
}


def decode_tiles(spec: LayoutSpec) -> Tiles:
    return TUNED_DECODE_TILES.get(spec.name, DECODE_TILES)


def decode_layouts(mode: str = "auto") -> tuple[frozenset[str], int]:
    """(layouts, min values): which weights a server should convert to the kernel layout
    (surojax.quant.laid_out.lay_out_model) so that decode takes the kernel. Under auto on a GPU the layouts with
    a measured crossover, for weights of at least DECODE_MIN_VALUES values; under pallas every one ("*": every
    quantised format with a kernel, plus the plain dtypes) at any size; none under xla or off GPU in auto."""
    _check_mode(mode)
    if mode == "xla" or (mode == "auto" and not on_gpu()):
        return frozenset(), 0
    if mode == "auto":
        return frozenset(name for name, m in DECODE_MAX_M.items() if m > 0), DECODE_MIN_VALUES
    return frozenset({"*"} | set(PLAIN)), 0


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"quant_matmul mode {mode!r}: expected one of {', '.join(MODES)}")


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (the kernels run compiled there, in interpret mode elsewhere)."""
    return jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Static options of the fused matmul: the tiles of both products, interpret mode (off GPU)."""

    fwd: Tiles
    bwd: Tiles
    interpret: bool = False
    splits: int = 1          # K splits of the forward (the decode form)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


def _frozen(w):
    """The cotangent of a frozen quantised weight: zeros (float0 for its integer leaves)."""
    return jax.tree.map(_zero_cotangent, w)


def _xla(x, w):
    return jnp.einsum("...k,kn->...n", x, w.dequantize(x.dtype))


@jax.custom_vjp
def xla_matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x [..., K] @ W -> [..., N]: dequantise in XLA, then its GEMM (the reference path). The backward
    dequantises again for dx = g @ W^T instead of keeping the bf16 copy as a residual: under a scan without
    remat, autodiff would otherwise save every layer's dequantised weight (the whole base in bf16)."""
    return _xla(x, w)


def _xla_fwd(x, w):
    return _xla(x, w), w


def _xla_bwd(w, g):
    return jnp.einsum("...n,kn->...k", g, w.dequantize(g.dtype)), _frozen(w)


xla_matmul.defvjp(_xla_fwd, _xla_bwd)


def _fused(x, w, opts):
    lw = w.kernel_layout(opts.fwd.kt)
    y = forward(x.reshape(-1, x.shape[-1]), lw, tiles=opts.fwd, interpret=opts.interpret, splits=opts.splits,
                layer=getattr(w, "layer", None))   # a layer of a stack read in place (surojax.quant.laid_out)
    return y.reshape(*x.shape[:-1], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fused_matmul(x: jax.Array, w: PackedWeight, opts: KernelOptions) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype by the fused kernel; differentiable in x only. The residual
    is the packed weight itself (re-laid out again for the backward kernel: one cheap pass over its bytes)."""
    return _fused(x, w, opts)


def _fused_fwd(x, w, opts):
    return _fused(x, w, opts), w


def _fused_bwd(opts, w, g):
    lw = w.kernel_layout(opts.bwd.kt)
    layer = getattr(w, "layer", None)
    if layer is not None:  # the backward kernel takes one layer: slice it out (serving never differentiates)
        lw = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), lw)
    dx = transposed(g.reshape(-1, g.shape[-1]), lw, tiles=opts.bwd, interpret=opts.interpret)
    return dx.reshape(*g.shape[:-1], -1), _frozen(w)


fused_matmul.defvjp(_fused_fwd, _fused_bwd)


def _tiles(w: PackedWeight, m: int | None) -> tuple[Tiles, Tiles]:
    spec = w.kernel_spec
    fwd, bwd = tiles_for(spec) if spec is not None else DEFAULT_TILES
    if spec is not None and m is not None and m <= DECODE_ROWS:
        fwd = dataclasses.replace(decode_tiles(spec), kt=fwd.kt)
    kt = getattr(w, "kt", None)          # a weight already laid out fixes the K tile
    if kt is not None:
        fwd, bwd = dataclasses.replace(fwd, kt=kt), dataclasses.replace(bwd, kt=kt)
    return fwd, bwd


def choose(w: PackedWeight, mode: str = "auto", m: int | None = None) -> str:
    """'pallas' or 'xla' for weight w under `mode` at M = m rows (None: unknown). Raises in mode pallas when the
    weight cannot take the kernels."""
    _check_mode(mode)
    if mode == "xla":
        return "xla"
    spec = w.kernel_spec
    fwd, bwd = _tiles(w, m)
    err = w.kernel_layout_error(fwd.kt) or (w.kernel_layout_error(bwd.kt) if bwd.kt != fwd.kt else None)
    if mode == "pallas":
        if err:
            raise ValueError(f"quant_matmul mode pallas: {err}")
        return "pallas"
    if not on_gpu() or err:
        return "xla"
    if (m is not None and getattr(w, "layout_is_free", False) and m <= DECODE_MAX_M.get(spec.name, 0)
            and w.shape[0] * w.shape[1] >= DECODE_MIN_VALUES):
        return "pallas"
    return "pallas" if spec.name in AUTO_PALLAS else "xla"


def quant_matmul(x: jax.Array, w: PackedWeight, mode: str = "auto") -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype, by the path `choose` picks (the decode form of the kernel
    for M <= DECODE_ROWS rows)."""
    m = int(np.prod(x.shape[:-1]))
    if choose(w, mode, m) == "xla":
        return xla_matmul(x, w)
    fwd, bwd = _tiles(w, m)
    splits = splits_for(m, x.shape[-1], w.shape[-1], fwd) if m <= DECODE_ROWS else 1
    return fused_matmul(x, w, KernelOptions(fwd, bwd, interpret=not on_gpu(), splits=splits))


__all__ = ["AUTO_PALLAS", "DECODE_MAX_M", "DECODE_MIN_VALUES", "DECODE_ROWS", "DECODE_TILES", "DEFAULT_TILES", "KernelOptions",
           "PackedWeight", "TUNED_DECODE_TILES", "TUNED_TILES", "choose", "decode_layouts", "decode_tiles",
           "fused_matmul", "MODES", "on_gpu", "quant_matmul", "tiles_for", "xla_matmul"]
