"""`cast_transpose(x, inv, dtype, bound)`: an FP8 operand in both layouts plus its amax, in one pass on a GPU.

    x [R, C] (bf16 / fp32), inv [] fp32 (1 / the dequantisation factor) -> q [R, C], q^T [C, R] in `dtype`
    (float8_e4m3fn / float8_e5m2), amax [] fp32 = max |x|

q = saturate(rne(x * inv)), computed in fp32: the bits of the pure-jnp reference (reference.py), which XLA runs as
three passes. On a GPU, when the tiles divide R and C, the Pallas kernel runs (kernel.py); elsewhere the reference
(on CPU it is the exact same arithmetic; interpret mode is for tests). Not differentiable: the FP8 GEMMs' custom
VJPs call it on values they already hold.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_cast.kernel import CastTiles, cast_transpose_kernel
from pallas_kernels.fp8_cast.reference import cast_transpose_reference

# 64 x 128, 4 warps: the best or near the best tile on each of the 8B step's operands in the sweep
# (benchmarks/fp8_cast_h200.py; figures: benchmarks/RESULTS.md#s13), faster than the first 64 x 64
CAST_TILES = CastTiles(64, 128, 4)


def kernel_fits(shape: tuple[int, ...], tiles: CastTiles = CAST_TILES) -> bool:
    return len(shape) == 2 and shape[0] % tiles.tr == 0 and shape[1] % tiles.tc == 0


def cast_transpose(x: jax.Array, inv: jax.Array, dtype, bound: float, *, tiles: CastTiles = CAST_TILES,
                   use_kernel: bool | None = None, interpret: bool | None = None):
    """(q, q^T, amax). use_kernel None: the kernel on a GPU when the tiles fit, the reference otherwise;
    interpret None: interpret mode off the GPU."""
    if x.ndim != 2:
        raise ValueError(f"cast_transpose: x must be [R, C], got {x.shape}")
    if use_kernel is None:
        use_kernel = jax.default_backend() == "gpu" and kernel_fits(x.shape, tiles)
    if not use_kernel:
        return cast_transpose_reference(x, inv, dtype, bound)
    if not kernel_fits(x.shape, tiles):
        raise ValueError(f"cast_transpose: tiles {tiles.tr}x{tiles.tc} do not divide x {x.shape}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    q, qt, partial = cast_transpose_kernel(x, jnp.asarray(inv, jnp.float32), dtype=jnp.dtype(dtype), bound=bound,
                                           tiles=tiles, interpret=interpret)
    return q, qt, jnp.max(partial)


__all__ = ["CAST_TILES", "cast_transpose", "kernel_fits"]
