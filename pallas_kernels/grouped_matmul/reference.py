"""Pure-jnp definition of the grouped matmul and its weight gradient (dense one-hot formulation, independent of
jax.lax.ragged_dot and of the kernel's tile schedule; O(A * E) memory: for tests on tiny shapes).

    grouped_matmul_reference  x [A, I], w [E, I, O], group_sizes [E] -> y [A, O]
    tgmm_reference            x [A, I], dy [A, O], group_sizes [E] -> dw [E, I, O]

Row r belongs to the group e with start_e <= r < end_e (rows sorted by group); rows past sum(group_sizes) belong
to none and give 0. fp32 accumulation (HIGHEST precision), the output in x's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def row_groups(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[A] int32: the group of every row, E for rows past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # [E]
    return jnp.sum(jnp.arange(num_rows, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1).astype(jnp.int32)


def _one_hot(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[A, E] float32: 1 where row a belongs to group e."""
    e = group_sizes.shape[0]
    return (row_groups(group_sizes, num_rows)[:, None] == jnp.arange(e)[None, :]).astype(jnp.float32)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """y [A, O]: y[r] = x[r] @ w[group of r], 0 past the groups."""
    hot = _one_hot(group_sizes, x.shape[0])
    y = jnp.einsum("ai,eio,ae->ao", x.astype(jnp.float32), w.astype(jnp.float32), hot,
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def tgmm_reference(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, out_dtype=None) -> jax.Array:
    """dw [E, I, O]: dw[e] = x_e^T @ dy_e over group e's rows (zeros for an empty group); out_dtype default x's."""
    hot = _one_hot(group_sizes, x.shape[0])
    dw = jnp.einsum("ae,ai,ao->eio", hot, x.astype(jnp.float32), dy.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
    return dw.astype(out_dtype or x.dtype)


__all__ = ["grouped_matmul_reference", "row_groups", "tgmm_reference"]
