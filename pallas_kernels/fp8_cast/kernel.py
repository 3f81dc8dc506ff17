"""One read of x for an FP8 GEMM's operands (Pallas, Triton lowering on GPU; `interpret=True` elsewhere).

    cast_transpose_kernel(x [R, C], inv []) -> q [R, C], q^T [C, R] (FP8), amax [R/tr, C/tc] (fp32, per tile)

Hopper's FP8 GEMMs (cuBLASLt) take both operands K-major, so a trainable linear needs every FP8 tensor in two
layouts: x as [M, K] (forward) and [K, M] (weight gradient), dy as [M, N] (input gradient) and [N, M] (weight
gradient), W as [K, N] (input gradient) and [N, K] (forward). Unfused, XLA reads each tensor three times: the amax
reduction, the quantising convert, the transpose of the FP8 result. Each program here loads one [tr, tc] tile of x,
quantises it (fp32 multiply by inv, clip to +-bound, round-to-nearest-even convert: the bits of the XLA
convert), stores the tile and its transpose, and the tile's max |x|; the caller takes the max of the [R/tr, C/tc]
partial amaxes (a tiny reduction). Tiles are powers of 2 that divide R and C (`kernel_fits`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class CastTiles:
    """tr x tc: the tile one program quantises and transposes; num_warps: Triton's launch parameter."""
    tr: int = 64
    tc: int = 64
    num_warps: int = 4


def _kernel(inv_ref, x_ref, q_ref, qt_ref, amax_ref, *, bound: float):
    x = x_ref[...].astype(jnp.float32)  # [tr, tc]
    q = jnp.clip(x * inv_ref[0], -bound, bound).astype(q_ref.dtype)
    q_ref[...] = q
    qt_ref[...] = q.T
    a = jnp.max(jnp.abs(x), axis=1, keepdims=True)  # [tr, 1]
    amax_ref[...] = jnp.max(a, axis=0, keepdims=True)  # [1, 1]


@functools.partial(jax.jit, static_argnames=("dtype", "bound", "tiles", "interpret"))
def cast_transpose_kernel(x: jax.Array, inv: jax.Array, *, dtype, bound: float, tiles: CastTiles = CastTiles(),
                          interpret: bool = False):
    """(q [R, C], q^T [C, R], partial amaxes [R/tr, C/tc]); R, C multiples of the tile (not checked here)."""
    r, c = x.shape
    tr, tc = tiles.tr, tiles.tc
    grid = (r // tr, c // tc)
    params = None if interpret else plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel, bound=bound),
        grid=grid,
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), pl.BlockSpec((tr, tc), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((tr, tc), lambda i, j: (i, j)), pl.BlockSpec((tc, tr), lambda i, j: (j, i)),
                   pl.BlockSpec((1, 1), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((r, c), dtype), jax.ShapeDtypeStruct((c, r), dtype),
                   jax.ShapeDtypeStruct(grid, jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="fp8_cast_transpose",
    )(jnp.reshape(inv.astype(jnp.float32), (1,)), x)


__all__ = ["CastTiles", "cast_transpose_kernel"]
