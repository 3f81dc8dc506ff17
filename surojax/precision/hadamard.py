"""The random Hadamard transform (RHT) of the NVFP4 recipe: 16x16 blocks along one axis.

    R = diag(signs) @ H16 / 4        H16 the Sylvester Hadamard matrix (+-1 entries), signs a fixed random +-1 vector
    rht(x) = x split into blocks of 16 along the last axis, each block b -> b @ R

R is orthogonal (R R^T = diag(s) H H^T diag(s) / 16 = I), so applying rht to *both* operands along their
contraction axis leaves a product unchanged: rht(a) . rht(b) = a R R^T b = a . b. The recipe applies it to the two
inputs of the weight-gradient GEMM (dW = x^T dy, contracted over the tokens) before they are quantised along that
same axis, which spreads a block's outlier over its 16 values (smaller block amax relative to the rest). Entries of
R are +-1/4, powers of two, so the transform itself adds no rounding beyond the fp32 sums.

The signs are drawn once from a seed (the run's `seed`) and fixed for the run, as in the paper and Transformer
Engine; they are kept as a static tuple, so the matrix is a compile-time constant.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SIZE = 16


def hadamard(n: int = SIZE) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix (+-1 entries, n a power of two), fp32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def random_signs(seed: int, n: int = SIZE) -> tuple[int, ...]:
    """n signs (+1 / -1) drawn from `seed` (NumPy's PCG64: the same on every host and backend)."""
    return tuple(int(s) for s in np.random.default_rng(seed).choice(np.array([-1, 1]), size=n))


def rht_matrix(signs: tuple[int, ...]) -> np.ndarray:
    """R = diag(signs) @ H / sqrt(n), orthogonal, fp32 [n, n]."""
    n = len(signs)
    return (np.asarray(signs, np.float32)[:, None] * hadamard(n) / np.float32(np.sqrt(n))).astype(np.float32)


def apply_rht(x: jax.Array, signs: tuple[int, ...]) -> jax.Array:
    """x [..., C] (C a multiple of len(signs)) -> each block of len(signs) along the last axis times R; fp32."""
    n = len(signs)
    if x.shape[-1] % n:
        raise ValueError(f"rht: the transformed axis ({x.shape[-1]}) must be a multiple of {n}")
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // n, n)
    out = jnp.einsum("...bi,ij->...bj", blocks, jnp.asarray(rht_matrix(signs)), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(x.shape)


__all__ = ["SIZE", "apply_rht", "hadamard", "random_signs", "rht_matrix"]
