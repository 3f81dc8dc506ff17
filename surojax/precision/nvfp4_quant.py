"""NVFP4 quantisers of the `nvfp4` training recipe (NVIDIA, "Pretraining Large Language Models with NVFP4",
arXiv 2509.25149, and Transformer Engine's NVFP4BlockScaling), in pure jnp.

A tensor is held as E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), one E4M3 scale per block of 16
and one fp32 scale per tensor. With amax = max |x| over the tensor and amax_b over a block (the paper's formulas):

    s_enc   = 6 * 448 / amax                      fp32 per tensor (1 where amax is 0 or not finite)
    scale_b = E4M3_rne(amax_b / 6 * s_enc)        the block's scale, saturating at 448
    q       = E2M1(x * (s_enc / scale_b))         round-to-nearest-even or stochastic, saturating at +-6
    x      ~= q * scale_b * g,   g = 1 / s_enc    (`global_decode`)

so the largest block of the tensor gets the largest E4M3 scale (448) and every block's largest value lands on (or
next to) 6. Block shapes: 1x16 along the last axis (activations, gradients: `quantize_1x16`) and 16x16 tiles over the
last two axes (weights: `quantize_16x16`, so the tile a value belongs to is the same in W and in W^T, and the
backward pass multiplies by exactly the transposed forward weight).

On Hopper the recipe's GEMMs are emulated: `Nvfp4Tensor.blocks()` is q * scale_b, which is *exact* in bf16 (a
2-significant-bit E2M1 value times a 4-significant-bit E4M3 scale has at most 6 significant bits, and bf16 has 8),
so a bf16 GEMM with fp32 accumulation on the two `blocks()` times g_a * g_b in fp32 is the Blackwell NVFP4 GEMM up
to accumulation order (Blackwell applies the block scales inside the tensor core and the global ones in the epilogue).

The roundings are written as arithmetic on the exponent (frexp / ldexp / round-half-even), not as casts to the
float8 / float4 dtypes: XLA GPU's float normalisation may fold a convert(f32 -> f8) read only by a convert back into
nothing (docs/precision.md, fp8_hybrid), which would silently drop the rounding. Tests hold them to ml_dtypes' casts.

Bounds (per value, before the global scale): RNE |x - deq| <= step / 2 of the value's E2M1 binade, where a block's
scale rounded down can push its largest value past 6, clipped to 6 (at most 6 * 2^-4 further: E4M3's half ulp);
SR |x - deq| < one step, E[deq] = x wherever no clipping happened. A block whose scale underflows E4M3
(amax_b < 6 * 2^-10 * g: about 2^-17 of the tensor's amax) is flushed to zero.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
Rounding = Literal["rne", "sr"]


def round_to_grid(mag: jax.Array, mantissa_bits: int, min_exponent: int, max_value: float,
                  rounding: Rounding = "rne", uniform: jax.Array | None = None) -> jax.Array:
    """Round mag >= 0 (fp32) to a small float format's grid (subnormals included), saturating at max_value.

    rne: round to nearest, ties to even (the even grid point has an even multiple of the binade's step);
    sr: down or up to the neighbouring grid points, up with probability (mag - lo) / (hi - lo), from `uniform`
    (fp32 U[0, 1), mag's shape)."""
    mag = jnp.minimum(mag.astype(jnp.float32), max_value)
    _, e = jnp.frexp(jnp.where(mag > 0, mag, 1.0))  # mag = m * 2^e, m in [0.5, 1)
    step = jnp.ldexp(jnp.float32(1.0), jnp.maximum(e - 1, min_exponent) - mantissa_bits)  # exact power of two
    units = mag / step  # exact: a division by a power of two
    if rounding == "rne":
        units = jnp.round(units)  # half to even
    elif rounding == "sr":
        if uniform is None:
            raise ValueError("stochastic rounding needs `uniform` draws")
        low = jnp.floor(units)
        units = low + (uniform < units - low).astype(jnp.float32)
    else:
        raise ValueError(f"rounding must be 'rne' or 'sr', got {rounding!r}")
    return jnp.minimum(units * step, max_value)


def round_e4m3(x: jax.Array) -> jax.Array:
    """x >= 0 to E4M3 (float8_e4m3fn) with round-to-nearest-even, saturating at 448; fp32."""
    return round_to_grid(x, 3, -6, E4M3_MAX)


def round_e2m1(x: jax.Array, rounding: Rounding = "rne", key: jax.Array | None = None) -> jax.Array:
    """Signed x to E2M1 values (saturating at +-6), round-to-nearest-even or stochastic (`key` required); fp32."""
    uniform = None
    if rounding == "sr":
        if key is None:
            raise ValueError("stochastic rounding needs a PRNG key")
        uniform = jax.random.uniform(key, x.shape, jnp.float32)
    mag = round_to_grid(jnp.abs(x), 1, 0, E2M1_MAX, rounding, uniform)
    return jnp.copysign(mag, x)  # -0 for a negative value rounded to zero, as the hardware conversion gives


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Nvfp4Tensor:
    """A quantised tensor: `values` E2M1 values (fp32, x's shape), `scale` the E4M3 block scales (fp32) of shape
    [..., R/16, C/16] (16x16 tiles) or [..., C/16] (1x16), `global_decode` the fp32 per-tensor factor g (a
    scalar; [..., 1, 1] for a stack of 16x16-tiled matrices)."""
    values: jax.Array
    scale: jax.Array
    global_decode: jax.Array
    tile: tuple[int, int] = dataclasses.field(default=(1, BLOCK), metadata=dict(static=True))

    def block_scale(self) -> jax.Array:
        """The block scales broadcast to the values' shape."""
        s = jnp.repeat(self.scale.astype(jnp.float32), BLOCK, axis=-1)
        if self.tile == (BLOCK, BLOCK):
            s = jnp.repeat(s, BLOCK, axis=-2)
        return s

    def blocks(self, dtype=jnp.bfloat16) -> jax.Array:
        """values * block scale: exact in bf16 (module docstring); the GEMM operand of the emulation."""
        return (self.values.astype(jnp.float32) * self.block_scale()).astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """values * block scale * global_decode."""
        return (self.values.astype(jnp.float32) * self.block_scale() * self.global_decode).astype(dtype)

    def compact(self) -> "Nvfp4Tensor":
        """The same tensor with values and block scales stored as float8_e4m3fn (exact: every E2M1 value and every
        E4M3 scale is an E4M3 number), a quarter of the fp32 bytes (what a frozen base keeps)."""
        return Nvfp4Tensor(self.values.astype(jnp.float8_e4m3fn), self.scale.astype(jnp.float8_e4m3fn),
                           self.global_decode, self.tile)

    @property
    def T(self) -> "Nvfp4Tensor":
        """The transposed 16x16-tiled tensor (the same tiles, so the same values transposed)."""
        if self.tile != (BLOCK, BLOCK):
            raise ValueError("only a 16x16-tiled tensor transposes into the same quantisation")
        return Nvfp4Tensor(jnp.swapaxes(self.values, -1, -2), jnp.swapaxes(self.scale, -1, -2), self.global_decode,
                           self.tile)


def global_encode(amax: jax.Array) -> jax.Array:
    """s_enc = 6 * 448 / amax in fp32; 1 where amax is 0 or not finite."""
    amax = jnp.asarray(amax, jnp.float32)
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, jnp.float32(E2M1_MAX * E4M3_MAX) / jnp.where(ok, amax, 1.0), 1.0)


def _encode(x, block_amax, s_enc, expand, rounding, key, tile) -> Nvfp4Tensor:
    """x fp32; block_amax [blocks]; s_enc broadcastable to both; expand(a) broadcasts per-block values to x."""
    scale = round_e4m3(block_amax / E2M1_MAX * s_enc)  # [blocks]
    ratio = jnp.where(scale > 0, s_enc / jnp.where(scale > 0, scale, 1.0), 0.0)  # an all-zero block stays 0
    values = round_e2m1(x * expand(ratio), rounding, key)
    return Nvfp4Tensor(values, scale, 1.0 / s_enc, tile)


def _check(dim: int, what: str) -> None:
    if dim % BLOCK:
        raise ValueError(f"nvfp4: {what} ({dim}) must be a multiple of {BLOCK}")


def quantize_1x16(x: jax.Array, rounding: Rounding = "rne", key: jax.Array | None = None) -> Nvfp4Tensor:
    """x [..., C] (C a multiple of 16) -> NVFP4 with one scale per 16 consecutive values along the last axis.
    rounding: "rne" (activations) or "sr" (gradients; `key` required)."""
    _check(x.shape[-1], "the blocked dimension")
    x = x.astype(jnp.float32)
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    block_amax = jnp.max(jnp.abs(grouped), axis=-1)  # [..., C/16]
    expand = lambda a: jnp.repeat(a, BLOCK, axis=-1)  # noqa: E731
    return _encode(x, block_amax, global_encode(jnp.max(block_amax)), expand, rounding, key, (1, BLOCK))


def quantize_16x16(w: jax.Array) -> Nvfp4Tensor:
    """w [..., R, C] (both multiples of 16) -> NVFP4 with one scale per 16x16 tile; round-to-nearest-even. A
    stack [L, R, C] gets one global scale per matrix (`global_decode` [L, 1, 1])."""
    *lead, r, c = w.shape
    _check(r, "rows"), _check(c, "columns")
    w = w.astype(jnp.float32)
    tiles = w.reshape(*lead, r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    block_amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))  # [..., R/16, C/16]
    expand = lambda a: jnp.repeat(jnp.repeat(a, BLOCK, axis=-1), BLOCK, axis=-2)  # noqa: E731
    s_enc = global_encode(jnp.max(block_amax, axis=(-2, -1), keepdims=True))  # per matrix: [..., 1, 1]
    return _encode(w, block_amax, s_enc, expand, "rne", None, (BLOCK, BLOCK))


__all__ = ["BLOCK", "E2M1_MAX", "E4M3_MAX", "Nvfp4Tensor", "Rounding", "global_encode", "quantize_1x16",
           "quantize_16x16", "round_e2m1", "round_e4m3", "round_to_grid"]
