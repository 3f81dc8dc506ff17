"""`gathered_gemv(x, w, expert_ids)`: the gathered GEMV (kernel.py) for a MoE call's few assignment rows, and the
choice between it and XLA's gather + batched product (pallas_kernels.grouped_matmul.gathered, the reference).

    x [A, I], w [E, I, O] (or a layer stack [L, E, I, O] read in place at `layer`), expert_ids [A] int
    -> y [A, O] in x's dtype, y[a] = x[a] @ w[expert_ids[a]]

Mode (the caller's; surojax passes SUROJAX_MOE_GATHER_KERNEL from its kernel settings, this package reads no
environment): auto | pallas | xla.
    pallas  the kernel for a plain (unquantised, float) w on a GPU; XLA off a GPU (interpret mode is for tests,
            which call gathered_gemv directly)
    xla     never
    auto    pallas: measured on an H100 (session 28, Qwen3-30B-A3B, bf16): one MoE layer at 1 row 53.1 us against
            XLA's gather 62.4, equal at 8 rows (227 / 228); one user through the engine (default tiles 128 x 64
            then) 197 tok/s against 181
`choose(w, mode)` says which path a call takes; `converts(mode)` whether a server should hand the kernel its layer
stacks of plain experts whole (surojax.quant.expert_stack: a scan slice feeding the kernel would be copied). No gradient here: pallas_kernels.grouped_matmul.gathered gives the
kernel the XLA path's backward.

Quantised experts: `gathered_quant_gemv(x, stack, expert_ids, num_experts=, base=)` runs quant_kernel.py on a stack
in the fused kernels' layout (pallas_kernels.quant_matmul.layout, arrays [R, ...]); `quant_converts(mode)` says
whether a server should lay its quantised expert stacks out for it (surojax.quant.expert_layout), `quant_choose`
which path a laid-out stack takes (the reference, reference.py, off a GPU and under xla).
    pallas  the kernel on a GPU
    auto    the same as xla until the kernel is measured on a GPU (QUANT_AUTO_PALLAS)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gathered_gemv.kernel import GatheredTiles, fit, gathered_gemv_kernel
from pallas_kernels.gathered_gemv.quant_kernel import QuantGatheredTiles, gathered_quant_kernel
from pallas_kernels.gathered_gemv.reference import gathered_layout_ref
from pallas_kernels.quant_matmul.layout import KernelLayout

MODES = ("auto", "pallas", "xla")
TILES = GatheredTiles()  # measured (kernel.GatheredTiles)
QUANT_TILES = QuantGatheredTiles()  # unmeasured: benchmarks/gathered_qgemv.py times the variants
QUANT_AUTO_PALLAS = False  # auto takes the quantised kernel once it is measured faster than XLA's path


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def converts(mode: str = "auto") -> bool:
    """Whether a server's plain expert stacks should be read in place by the kernel under `mode`."""
    _check_mode(mode)
    return mode in ("auto", "pallas") and on_gpu()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"gathered GEMV mode {mode!r}: expected one of {', '.join(MODES)}")


def choose(w, mode: str = "auto") -> str:
    """'pallas' or 'xla' for a gathered product of weight w under `mode` (module docstring)."""
    _check_mode(mode)
    plain = isinstance(w, jax.Array) and w.ndim in (3, 4) and jnp.issubdtype(w.dtype, jnp.floating)
    return "pallas" if mode in ("auto", "pallas") and plain and on_gpu() else "xla"


def gathered_gemv(x: jax.Array, w: jax.Array, expert_ids: jax.Array, *, layer: jax.Array | int | None = None,
                  tiles: GatheredTiles | None = None, interpret: bool | None = None) -> jax.Array:
    """y [A, O] by the kernel (module docstring); interpret: default off on a GPU backend, on elsewhere. Raises
    ValueError naming what does not fit: shapes, a non-float x or w, non-integer ids, a layer index without a
    stack (or a stack without one)."""
    if x.ndim != 2 or expert_ids.shape != (x.shape[0],) or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"gathered GEMV: x {x.shape} [A, I], expert_ids {expert_ids.shape} {expert_ids.dtype} "
                         "[A] integers")
    if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(w.dtype, jnp.floating)):
        raise ValueError(f"gathered GEMV: x {x.dtype} and w {w.dtype} must be floating point (a quantised weight "
                         "takes the XLA path)")
    if w.ndim == 4:
        if layer is None:
            raise ValueError(f"gathered GEMV: a layer stack {w.shape} [L, E, I, O] needs the layer index")
        num_experts = w.shape[1]
        base = jnp.asarray(layer, jnp.int32).reshape(1) * num_experts
        w = w.reshape(-1, *w.shape[2:])  # [L E, I, O]: free
    elif w.ndim == 3:
        if layer is not None:
            raise ValueError(f"gathered GEMV: a layer index given for one layer's experts {w.shape}")
        num_experts, base = w.shape[0], jnp.zeros((1,), jnp.int32)
    else:
        raise ValueError(f"gathered GEMV: w {w.shape}, expected [E, I, O] or [L, E, I, O]")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"gathered GEMV: x {x.shape} [A, I], w {w.shape} [E, I, O]")
    tiles = fit(tiles or TILES, w.shape[1], w.shape[2])
    return gathered_gemv_kernel(x, w, expert_ids, base, num_experts=num_experts, tiles=tiles,
                                interpret=jax.default_backend() != "gpu" if interpret is None else interpret)


def quant_converts(mode: str = "auto") -> bool:
    """Whether a server's quantised expert stacks should be laid out for the quantised kernel under `mode`."""
    _check_mode(mode)
    return on_gpu() and (mode == "pallas" or (mode == "auto" and QUANT_AUTO_PALLAS))


def quant_choose(mode: str = "auto") -> str:
    """'pallas' or 'xla' (the reference) for a gathered product of a laid-out quantised stack under `mode`."""
    return "pallas" if quant_converts(mode) else "xla"


def gathered_quant_gemv(x: jax.Array, stack: KernelLayout, expert_ids: jax.Array, *, num_experts: int,
                        base: jax.Array | int = 0, mode: str = "pallas", tiles: QuantGatheredTiles | None = None,
                        interpret: bool | None = None) -> jax.Array:
    """y [A, N] in x's dtype, y[a] = x[a] @ decode(stack[base + expert_ids[a]]): stack a KernelLayout with arrays
    [R, ...] (R = E, or L E with base = layer x E). mode: pallas runs the kernel (interpret mode off a GPU unless
    `interpret` says otherwise), xla the reference; auto as `quant_choose`."""
    _check_mode(mode)
    if x.ndim != 2 or expert_ids.shape != (x.shape[0],) or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"gathered quantised GEMV: x {x.shape} [A, K], expert_ids {expert_ids.shape} "
                         f"{expert_ids.dtype} [A] integers")
    base = jnp.asarray(base, jnp.int32).reshape(1)
    if mode != "pallas" and quant_choose(mode) == "xla":  # pallas runs the kernel, interpreted off a GPU
        return gathered_layout_ref(x, stack, expert_ids, base)
    return gathered_quant_kernel(x, stack, expert_ids, base, num_experts=num_experts, tiles=tiles or QUANT_TILES,
                                 interpret=not on_gpu() if interpret is None else interpret)


__all__ = ["MODES", "QUANT_TILES", "TILES", "GatheredTiles", "QuantGatheredTiles", "choose", "converts",
           "gathered_gemv", "gathered_quant_gemv", "on_gpu", "quant_choose", "quant_converts"]
