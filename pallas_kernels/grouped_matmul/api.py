"""`grouped_matmul(x, w, group_sizes)`: the dropless-MoE grouped matmul, differentiable.

    x [A, I] (rows sorted by group), w [E, I, O], group_sizes [E] int32 -> y [A, O]

Rows [offset_e, offset_e + group_sizes[e]) multiply w[e]; rows past sum(group_sizes) give 0 and a total past A is
cut at A (jax.lax.ragged_dot's semantics). y in x's dtype, fp32 accumulation. The custom_vjp's backward:

    dx = gmm(dy, w, transpose_rhs=True)   [A, I], dy @ w[e]^T per group, in x's dtype
    dw = tgmm(x, dy)                      [E, I, O], x_e^T @ dy_e per group (0 for an empty group), in w's dtype

and no cotangent for group_sizes (integers). Saved for the backward: x, w, group_sizes (no activations).

On a GPU the kernels run as Triton; on any other backend in Pallas interpret mode (`interpret=None`), which is
slow and meant for tests. Whether this kernel or jax.lax.ragged_dot is faster on the H200 is for
benchmarks/grouped_matmul_h200.py to say (its figures go to benchmarks/RESULTS.md). Tiles: `GmmTiles` (forward
and dx) and `TgmmTiles` (dw), defaults below; a tile that does not divide I or O is halved until it does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.kernel import GmmTiles, TgmmTiles, gmm, tgmm

# Defaults until benchmarks/grouped_matmul_h200.py's tuning says otherwise: tiles that compile for sm_90 with wgmma
# and without register spills (a 128 x 128 fp32 accumulator needs 8 warps), 96 KiB of shared memory.
GMM_TILES = GmmTiles(tm=128, tk=64, tn=128, num_warps=8, num_stages=3)
TGMM_TILES = TgmmTiles(tm=64, ti=128, to=128, num_warps=8, num_stages=3)


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() != "gpu" if interpret is None else interpret


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_matmul(x, w, group_sizes, tiles: GmmTiles, tgmm_tiles: TgmmTiles, interpret: bool):
    return gmm(x, w, group_sizes, tiles=tiles, interpret=interpret)


def _fwd(x, w, group_sizes, tiles, tgmm_tiles, interpret):
    return gmm(x, w, group_sizes, tiles=tiles, interpret=interpret), (x, w, group_sizes)


def _bwd(tiles, tgmm_tiles, interpret, res, dy):
    x, w, group_sizes = res
    dx = gmm(dy, w, group_sizes, transpose_rhs=True, tiles=tiles, interpret=interpret).astype(x.dtype)
    dw = tgmm(x, dy, group_sizes, tiles=tgmm_tiles, interpret=interpret, out_dtype=w.dtype)
    return dx, dw, None


_grouped_matmul.defvjp(_fwd, _bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tiles: GmmTiles = GMM_TILES,
                   tgmm_tiles: TgmmTiles = TGMM_TILES, interpret: bool | None = None) -> jax.Array:
    """y [A, O] (shapes and semantics: the module docstring). interpret None: on any backend but GPU. A bad tile
    is a ValueError naming it; so is a shape mismatch."""
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: x {x.shape} [A, I], w {w.shape} [E, I, O], group_sizes "
                         f"{group_sizes.shape} [E]")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integers, got {group_sizes.dtype}")
    return _grouped_matmul(x, w, group_sizes.astype(jnp.int32), tiles, tgmm_tiles, _interpret(interpret))


# jax.lax.ragged_dot on the GPU (JAX 0.11.2) is no grouped GEMM: its lowering materialises dense [A, E, ...]
# intermediates (tens of times the kernel's time on Qwen3-30B-A3B's expert projections, and its gradient runs out
# of memory: benchmarks/RESULTS.md#s6), so on a GPU the kernel runs it. Elsewhere ragged_dot is exact and fast enough.
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def grouped_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The grouped matmul the model runs: this kernel on a GPU for bf16 / fp16 operands, jax.lax.ragged_dot
    elsewhere (CPU; fp32 parity runs, where Triton's dots would use TF32). Same contract as `grouped_matmul`."""
    w = w.astype(x.dtype)
    if jax.default_backend() == "gpu" and jnp.dtype(x.dtype) in _KERNEL_DTYPES:
        return grouped_matmul(x, w, group_sizes)
    return jax.lax.ragged_dot(x, w, group_sizes)


__all__ = ["GMM_TILES", "TGMM_TILES", "grouped_dot", "grouped_matmul"]
