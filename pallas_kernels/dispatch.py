"""`quant_matmul(x, w)`: the matmul of every quantised weight (QuantFormat.matmul calls it), choosing between

    pallas  the fused dequantise + matmul kernels (pallas_kernels.fused) under a custom_vjp: forward y = x @ W,
            backward dx = g @ W^T by the transposed kernel, no gradient for the frozen W (zero cotangents)
    xla     x @ w.dequantize(x.dtype): XLA dequantises the weight into a bf16 temporary and runs its GEMM; a
            custom_vjp dequantises again in the backward for dx = g @ W^T (no bf16 copy kept as a residual)

The choice is `SUROJAX_QUANT_MATMUL` = auto | pallas | xla (read when the matmul is traced; default auto).
auto = xla off GPU, and on GPU pallas only for the formats listed in AUTO_PALLAS (the ones where the H200
benchmark, benchmarks/quant_matmul_h200.py, measured the fused kernel faster than dequantise-then-matmul), xla
for the rest. pallas forces the kernels (interpret mode off GPU: slow, for tests) and raises when a weight cannot
take them (a format without a kernel, stacked leaves, K or N off the tiles); auto falls back to xla instead.

The kernels see one layer's weight: the decoder's lax.scan slices the stacked [L, ...] leaves before the call.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fused import Tiles, forward, transposed
from pallas_kernels.layout import SPECS, layout_error, to_layout

ENV = "SUROJAX_QUANT_MATMUL"
MODES = ("auto", "pallas", "xla")

# Formats whose fused kernel beat XLA's dequantise-then-matmul (forward + input gradient, M = 8192, Qwen3-8B
# shapes) on the H200, as benchmarks/quant_matmul_h200.py prints it. Empty: XLA won for every format measured
# (benchmarks/RESULTS.md, "Quantised bases": fused 0.24-0.48x of bf16, XLA 0.86-0.95x).
AUTO_PALLAS: frozenset[str] = frozenset()

# Default tiles per format: (forward, transposed). The benchmark prints its best configurations per format.
DEFAULT_TILES: dict[str, tuple[Tiles, Tiles]] = {
    name: (Tiles(bm=128, bn=128, kt=128, num_warps=8, num_stages=3),
           Tiles(bm=128, bn=64, kt=128, num_warps=8, num_stages=3)) for name in SPECS}


def matmul_mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Static options of the fused matmul: the tiles of both products, interpret mode (off GPU)."""

    fwd: Tiles
    bwd: Tiles
    interpret: bool = False


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
def xla_matmul(x: jax.Array, w) -> jax.Array:
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
    lw = to_layout(w, opts.fwd.kt)
    y = forward(x.reshape(-1, x.shape[-1]), lw, tiles=opts.fwd, interpret=opts.interpret)
    return y.reshape(*x.shape[:-1], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fused_matmul(x: jax.Array, w, opts: KernelOptions) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype by the fused kernel; differentiable in x only. The residual
    is the packed weight itself (re-laid out again for the backward kernel: one cheap pass over its bytes)."""
    return _fused(x, w, opts)


def _fused_fwd(x, w, opts):
    return _fused(x, w, opts), w


def _fused_bwd(opts, w, g):
    lw = to_layout(w, opts.bwd.kt)
    dx = transposed(g.reshape(-1, g.shape[-1]), lw, tiles=opts.bwd, interpret=opts.interpret)
    return dx.reshape(*g.shape[:-1], -1), _frozen(w)


fused_matmul.defvjp(_fused_fwd, _fused_bwd)


def choose(w, mode: str | None = None) -> str:
    """'pallas' or 'xla' for weight w under `mode` (default: the env var). Raises in mode pallas when the weight
    cannot take the kernels."""
    mode = mode or matmul_mode()
    if mode == "xla":
        return "xla"
    tiles = DEFAULT_TILES.get(getattr(w, "name", ""))
    err = layout_error(w, tiles[0].kt) if tiles else f"no fused kernel for format {getattr(w, 'name', w)!r}"
    if tiles and not err and tiles[1].kt != tiles[0].kt:
        err = layout_error(w, tiles[1].kt)
    if mode == "pallas":
        if err:
            raise ValueError(f"{ENV}=pallas: {err}")
        return "pallas"
    return "pallas" if on_gpu() and not err and w.name in AUTO_PALLAS else "xla"


def quant_matmul(x: jax.Array, w, mode: str | None = None) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype, by the path `choose` picks."""
    if choose(w, mode) == "xla":
        return xla_matmul(x, w)
    fwd, bwd = DEFAULT_TILES[w.name]
    return fused_matmul(x, w, KernelOptions(fwd, bwd, interpret=not on_gpu()))


__all__ = ["AUTO_PALLAS", "DEFAULT_TILES", "ENV", "KernelOptions", "choose", "fused_matmul", "matmul_mode",
           "quant_matmul", "xla_matmul"]
