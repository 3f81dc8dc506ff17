"""The pure-jnp meaning of `adam8bit_kernel`: the same operands, the same operations in the same order, over the
whole [NB, 256] array at once (XLA runs it as several passes where the kernel makes one).

Each row is one 256-value quantisation block; row r belongs to layer r // rows_per_layer, whose (c1, c2, step)
scale it. The nearest-code search is the bucket table's (optim_8bit.nearest_code_index's, in int32 arithmetic).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

PREFIX_SHIFT = 16  # the bucket table's key prefix (optim_8bit.PREFIX_SHIFT)


@dataclasses.dataclass(frozen=True)
class Adam8bitHyper:
    """The update's constants (static: one compiled kernel per set)."""
    b1: float
    b2: float
    eps: float
    weight_decay: float  # 0: no decay term at all (optax skips it)
    max_norm: float | None  # the global-norm clip (None: no clip)


def nearest_code(normed: jax.Array, first: jax.Array, bounds: jax.Array) -> jax.Array:
    """The index (uint8) of the code nearest each value of `normed` (ties: the lower; NaN: 255), from the bucket
    table: the top 16 bits of the value's order key pick a bucket, one compare with its bound decides. The kernel
    runs the same code on its table refs."""
    bits = jax.lax.bitcast_convert_type(normed, jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    bucket = (key >> PREFIX_SHIFT) + (1 << (31 - PREFIX_SHIFT))  # [0, 2^16)
    below = first[bucket].astype(jnp.int32)
    idx = jnp.where(normed <= bounds[below], below, below + 1)
    return jnp.where(jnp.isnan(normed), 255, idx).astype(jnp.uint8)


def quantize_rows(x: jax.Array, first: jax.Array, bounds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [NB, 256] -> (codes [NB, 256] uint8, absmax [NB] fp32): each row scaled by its absmax, then coded."""
    absmax = jnp.max(jnp.abs(x), axis=1)
    normed = x / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    return nearest_code(normed, first, bounds), absmax


def adam8bit_reference(glob, layer_scalars, g, p, m_codes, m_absmax, v_codes, v_absmax, tables, *,
                       hyper: Adam8bitHyper, decay: bool, rows_per_layer: int):
    """adam8bit_kernel's operands and results (kernel.py), without tiles: (p, m_codes, m_absmax, v_codes,
    v_absmax). Not in place: new arrays."""
    h = hyper
    smap, umap, sfirst, sbounds, ufirst, ubounds = tables
    denom, norm = glob[0], glob[1]
    per_row = jnp.repeat(layer_scalars, rows_per_layer, axis=0)  # [NB, 4]
    c1, c2, step = per_row[:, 0:1], per_row[:, 1:2], per_row[:, 2:3]
    g = g.astype(jnp.float32) / denom
    if h.max_norm:
        g = jnp.where(norm < h.max_norm, g, (g / norm) * h.max_norm)
    m = smap[m_codes.astype(jnp.int32)] * m_absmax[:, None]
    v = umap[v_codes.astype(jnp.int32)] * v_absmax[:, None]
    m = h.b1 * m + (1.0 - h.b1) * g
    v = h.b2 * v + (1.0 - h.b2) * g * g
    d = (m / c1) / (jnp.sqrt(v / c2) + h.eps)
    if decay:
        d = d + h.weight_decay * p
    new_p = (p + step * d).astype(p.dtype)
    mc, ma = quantize_rows(m, sfirst, sbounds)
    vc, va = quantize_rows(v, ufirst, ubounds)
    return new_p, mc, ma, vc, va


__all__ = ["Adam8bitHyper", "adam8bit_reference", "nearest_code", "quantize_rows"]
