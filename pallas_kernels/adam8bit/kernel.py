"""One pass of 8-bit AdamW over a stacked parameter (Pallas, Triton lowering on GPU; `interpret=True` elsewhere).

    adam8bit_kernel(g [NB, 256], p [NB, 256], m codes / absmax, v codes / absmax, per-layer scalars, tables)
        -> p, m codes, m absmax, v codes, v absmax        (each written in place over its input)

Every row is one quantisation block of 256 values (the 8-bit optimizer's block); the rows of one layer are
contiguous (`rows_per_layer` of them). A program takes `rows` blocks, all of one layer, and does in registers what
the XLA form does in ~8 passes over the tensor (surojax/train/optim_8bit.py, which builds the operands):

    g  = g_sum / denom, clipped by the global norm (select(norm < max_norm, g, g / norm * max_norm))
    m  = SIGNED[m_codes] * m_absmax;  v = UNSIGNED[v_codes] * v_absmax                (dequantise)
    m  = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    d  = (m / c1) / (sqrt(v / c2) + eps)                    c1, c2: the layer's bias corrections
    d += wd * p    (decayed leaves only);   p += step * d   step: -lr of the layer's schedule count
    m, v -> per-block absmax, then the index of the nearest code (the bucket-table search of optim_8bit's
            nearest_code_index: the top 16 bits of the value's order key pick a bucket, one compare decides)

The same operations in the same order as the XLA form. Where a compiler contracts a multiply and an add into one
fused multiply-add (XLA CPU does, by fusion; Triton does; its fp32 division may also be the 2-ulp `div.full`)
the roundings differ by an ulp or two: tests hold the kernel (interpret mode) to the XLA form within a few ulps.
Reads 10 bytes per parameter (g fp32, p, two codes), writes 6: the XLA form reads and writes each tensor several
times and copies each layer's slices (benchmarks/RESULTS.md#s13).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# the update's constants; the per-block absmax and nearest-code search (the same code as the reference's)
from pallas_kernels.adam8bit.reference import Adam8bitHyper, quantize_rows

BLOCK = 256  # values per quantisation block (bitsandbytes' block for its 8-bit optimizers)


@dataclasses.dataclass(frozen=True)
class Adam8bitTiles:
    rows: int = 16  # blocks per program (rows * 256 values)
    num_warps: int = 4


def _kernel(glob_ref, layer_ref, g_ref, p_ref, mc_ref, ma_ref, vc_ref, va_ref, smap_ref, umap_ref, sfirst_ref,
            sbounds_ref, ufirst_ref, ubounds_ref, p_out, mc_out, ma_out, vc_out, va_out, *, hyper: Adam8bitHyper,
            decay: bool):
    h = hyper
    denom, norm = glob_ref[0], glob_ref[1]
    c1, c2, step = layer_ref[0, 0], layer_ref[0, 1], layer_ref[0, 2]
    g = g_ref[...].astype(jnp.float32) / denom
    if h.max_norm:
        g = jnp.where(norm < h.max_norm, g, (g / norm) * h.max_norm)
    m = smap_ref[mc_ref[...].astype(jnp.int32)] * ma_ref[...][:, None]
    v = umap_ref[vc_ref[...].astype(jnp.int32)] * va_ref[...][:, None]
    m = h.b1 * m + (1.0 - h.b1) * g
    v = h.b2 * v + (1.0 - h.b2) * g * g
    d = (m / c1) / (jnp.sqrt(v / c2) + h.eps)
    p = p_ref[...]
    if decay:
        d = d + h.weight_decay * p
    p_out[...] = (p + step * d).astype(p_out.dtype)
    mc_out[...], ma_out[...] = quantize_rows(m, sfirst_ref, sbounds_ref)  # the tables are read as refs
    vc_out[...], va_out[...] = quantize_rows(v, ufirst_ref, ubounds_ref)


@functools.partial(jax.jit, static_argnames=("hyper", "decay", "rows_per_layer", "tiles", "interpret"))
def adam8bit_kernel(glob, layer_scalars, g, p, m_codes, m_absmax, v_codes, v_absmax, tables, *,
                    hyper: Adam8bitHyper, decay: bool, rows_per_layer: int, tiles: Adam8bitTiles = Adam8bitTiles(),
                    interpret: bool = False):
    """glob [2] fp32 (denom, global grad norm); layer_scalars [L, 4] fp32 (c1, c2, step, unused) per layer;
    g / p [NB, 256] (NB = L * rows_per_layer); codes [NB, 256] uint8, absmax [NB] fp32; tables = (signed map [256],
    unsigned map [256], signed first [65536] uint8, signed bounds [256], unsigned first, unsigned bounds).
    tiles.rows must divide rows_per_layer. Returns (p, m_codes, m_absmax, v_codes, v_absmax)."""
    nb = g.shape[0]
    rows = tiles.rows
    per_layer = rows_per_layer // rows
    row_block = pl.BlockSpec((rows, BLOCK), lambda i: (i, 0))
    vec_block = pl.BlockSpec((rows,), lambda i: (i,))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)

    params = None if interpret else plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel, hyper=hyper, decay=decay),
        grid=(nb // rows,),
        in_specs=[whole(glob), pl.BlockSpec((1, 4), lambda i: (i // per_layer, 0)), row_block, row_block, row_block,
                  vec_block, row_block, vec_block, *[whole(t) for t in tables]],
        out_specs=[row_block, row_block, vec_block, row_block, vec_block],
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype), jax.ShapeDtypeStruct(m_codes.shape, jnp.uint8),
                   jax.ShapeDtypeStruct(m_absmax.shape, jnp.float32),
                   jax.ShapeDtypeStruct(v_codes.shape, jnp.uint8), jax.ShapeDtypeStruct(v_absmax.shape, jnp.float32)],
        input_output_aliases={3: 0, 4: 1, 5: 2, 6: 3, 7: 4},
        compiler_params=params,
        interpret=interpret,
        name="adam8bit_update",
    )(glob, layer_scalars, g, p, m_codes, m_absmax, v_codes, v_absmax, *tables)


__all__ = ["Adam8bitHyper", "Adam8bitTiles", "adam8bit_kernel", "BLOCK"]
