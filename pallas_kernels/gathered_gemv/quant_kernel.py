"""The gathered quantised GEMV: y [A, N], y[a] = x[a] [K] @ W[base + expert_ids[a]] [K, N], each routed expert's
quantised weight read in place from a stack in the fused kernels' layout (pallas_kernels.quant_matmul.layout:
codes, float32 scales and offsets) and decoded in registers, one Pallas kernel (Triton lowering on GPU,
`interpret=True` elsewhere). The quantised counterpart of kernel.py: XLA's path gathers the A experts' packed
bytes, writes them dequantised ([A, K, N] in bf16: more bytes than a bf16 expert stack would have read) and
reads them again; this kernel reads only the routed experts' quantised bytes, once.

    stack   codes [R, K/2 or K, N], scale / offset [R, K/G, N]   (R = E, or L E for a layer stack read at
            base = layer x E; the arrays are flattened to [R rows, N] and each program offsets its expert's rows)
    grid    (N / bn, A, S)   program (j, a, s) owns columns [j bn, (j+1) bn) of row a, over the K tiles of split s
    loop    over its K tiles (the layout's kt values each): decode the [kt, bn] tile (two [kt/2, bn] halves for
            4-bit codes: quant_matmul.kernel._tile, the fused GEMM's own decoding) and multiply with x[a]'s slice
    body    "fma": acc [rows, bn] += x[:, None] * w in fp32 (no tensor core: one row per program);
            "dot": x's slice as row 0 of a [16, rows] tile (rows 1-15 zero) through a tensor-core dot, fp32
            accumulation, so that Triton pipelines the weight loads that feed a dot
    out     S = 1: y [A, N] in x's dtype; S > 1: fp32 partials [S, A, N], summed (and cast) by the caller

Math as the XLA path's (pallas_kernels.gathered_gemv.reference): the decoded value w = decode(code) * scale
(- offset) in fp32, cast to x's dtype, products and sums in fp32, y cast to x's dtype; only the summation order
differs. The ids must lie in [0, E): the kernel clamps them (it never reads outside the stack). Serving only: no
gradient (a quantised base is frozen; the XLA path is the differentiable one).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quant_matmul.kernel import _refs, _tile
from pallas_kernels.quant_matmul.layout import KernelLayout, layout_error

BODIES = ("fma", "dot")
DOT_ROWS = 16  # Triton's smallest dot tile: x's one row padded to it


@dataclasses.dataclass(frozen=True)
class QuantGatheredTiles:
    """bn: output columns per program (a power of 2 >= 16 dividing N); splits: K splits S (dividing the K tile
    count; 0 = `splits_for`: enough programs for the GPU); body: fma | dot (module docstring); Triton's
    num_warps / num_stages."""

    bn: int = 64
    splits: int = 0
    body: str = "fma"
    num_warps: int = 4
    num_stages: int = 3

    def label(self) -> str:
        return f"{self.body}-bn{self.bn}-s{self.splits or 'auto'}-w{self.num_warps}-st{self.num_stages}"


def fit_bn(bn: int, n: int) -> int:
    """The largest power of 2 <= bn (>= 16) dividing N (the layout guarantees 16 divides N)."""
    bn = max(16, 1 << (max(bn, 1).bit_length() - 1))
    while bn > 16 and n % bn:
        bn //= 2
    return bn


def splits_for(a: int, k_tiles: int, n_tiles: int, programs: int = 264) -> int:
    """The smallest divisor S of the K tile count with A x N/bn x S >= `programs` (two per SM of an H100 / H200),
    else every K tile its own split."""
    for s in range(1, k_tiles + 1):
        if k_tiles % s == 0 and a * n_tiles * s >= programs:
            return s
    return k_tiles


def _kernel(base_ref, ids_ref, x_ref, q_ref, *rest, spec, kt: int, n_k: int, num_experts: int, code_rows: int,
            scale_rows: int, bn: int, body: str, split_out: bool):
    s_ref, o_ref, y_ref = _refs(rest, spec)
    j, a, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    e = base_ref[0] + jnp.clip(ids_ref[a], 0, num_experts - 1)
    base = (e * code_rows, e * scale_rows)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    rows = kt // 2 if spec.nibble else kt
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None  # fp32 x: no TF32 rounding

    def step(t, acc):
        tile = s * n_k + t
        for w, k0 in _tile(q_ref, s_ref, o_ref, tile, cols, spec, kt, x_ref.dtype, base):
            x = x_ref.at[a, pl.ds(tile * kt + k0, rows)][...]  # [rows]
            if body == "dot":
                first = jax.lax.broadcasted_iota(jnp.int32, (DOT_ROWS, rows), 0) == 0
                x16 = jnp.where(first, jnp.broadcast_to(x[None, :], (DOT_ROWS, rows)), jnp.zeros((), x.dtype))
                acc = acc + jax.lax.dot_general(x16, w, (((1,), (0,)), ((), ())), preferred_element_type=f32,
                                                precision=precision)
            else:
                acc = acc + x.astype(f32)[:, None] * w.astype(f32)
        return acc

    acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((DOT_ROWS if body == "dot" else rows, bn), f32))
    y = jnp.sum(acc, axis=0)  # [bn] (the dot body's rows 1-15 are zero)
    if split_out:
        y_ref.at[s, a, cols][...] = y
    else:
        y_ref.at[a, cols][...] = y.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_experts", "tiles", "interpret"))
def gathered_quant_kernel(x: jax.Array, stack: KernelLayout, expert_ids: jax.Array, base: jax.Array, *,
                          num_experts: int, tiles: QuantGatheredTiles = QuantGatheredTiles(),
                          interpret: bool = False) -> jax.Array:
    """y [A, N] in x's dtype: y[a] = x[a] @ decode(stack[base + expert_ids[a]]). x [A, K] float; stack a
    KernelLayout whose arrays carry a leading R axis (R = E, or L E with base = layer x E); expert_ids [A] int;
    base [1] int32. ValueError naming what does not fit."""
    a_dim, k = x.shape
    kk, n = stack.shape
    spec, kt = stack.spec, stack.kt
    code_rows = k // 2 if spec.nibble else k
    scale_rows = k // spec.group if spec.group else 0
    if kk != k or stack.codes.ndim != 3 or stack.codes.shape[1:] != (code_rows, n) \
            or expert_ids.shape != (a_dim,) or stack.codes.shape[0] % num_experts:
        raise ValueError(f"gathered quantised GEMV: x {x.shape} [A, K], codes {stack.codes.shape} [R, {code_rows}, "
                         f"{n}] of {num_experts} experts a layer ({spec.name}, K x N = {stack.shape}), expert_ids "
                         f"{expert_ids.shape} [A]")
    err = layout_error(spec, (k, n), kt)
    if err:
        raise ValueError(f"gathered quantised GEMV: {err}")
    if tiles.body not in BODIES:
        raise ValueError(f"gathered quantised GEMV: body {tiles.body!r}, expected one of {', '.join(BODIES)}")
    bn = fit_bn(tiles.bn, n)
    k_tiles = k // kt
    splits = tiles.splits or splits_for(a_dim, k_tiles, n // bn)
    if k_tiles % splits:
        raise ValueError(f"gathered quantised GEMV: splits={splits} must divide the {k_tiles} K tiles of K={k} "
                         f"(kt={kt})")
    weights = [stack.codes] + ([stack.scale] if spec.group else []) + ([stack.offset] if spec.has_offset else [])
    weights = [w.reshape(-1, n) for w in weights]  # [R rows, N]: free
    split_out = splits > 1
    out_shape = jax.ShapeDtypeStruct((splits, a_dim, n) if split_out else (a_dim, n),
                                     jnp.float32 if split_out else x.dtype)
    kernel = functools.partial(_kernel, spec=spec, kt=kt, n_k=k_tiles // splits, num_experts=num_experts,
                               code_rows=code_rows, scale_rows=scale_rows, bn=bn, body=tiles.body,
                               split_out=split_out)
    params = None if interpret else plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    y = pl.pallas_call(kernel, out_shape=out_shape, grid=(n // bn, a_dim, splits), compiler_params=params,
                       interpret=interpret, name=f"gathered_qgemv_{spec.name}")(
        base.astype(jnp.int32).reshape(1), expert_ids.astype(jnp.int32), x, *weights)
    return y.sum(axis=0).astype(x.dtype) if split_out else y


__all__ = ["BODIES", "QuantGatheredTiles", "fit_bn", "gathered_quant_kernel", "splits_for"]
