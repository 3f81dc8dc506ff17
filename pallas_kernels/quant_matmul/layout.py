"""The kernel layout: one quantised [K, N] weight re-laid out so that a [kt, bn] tile of the GEMM is a block of
rows of every array (K on the row axis, N contiguous), with the format's byte semantics unchanged.

    codes   [K/2, N] uint8   "nibble" formats (4-bit codes): two codes per byte, half-split per K tile of `kt`
                             rows: byte row t*kt/2 + r holds value k = t*kt + r in its LOW nibble and
                             k = t*kt + kt/2 + r in its HIGH nibble, so a kernel unpacks a [kt/2, bn] byte tile
                             into the two contiguous halves of its K tile (two dots, no interleave)
            [K, N]   uint8 / int8 / float8_e4m3fn   "byte" formats (one code per byte)
            [K, N]   bfloat16 / float16 / float32   an unquantised weight as is (`plain_layout`, group 0: no
                             scale, no offset; the decode-shaped kernels serve plain models through it)
    scale   [K/G, N] float32 one scale per G consecutive values of a column (G = the format's block along K)
    offset  [K/G, N] float32 the subtracted minimum (formats with `has_offset`), else None

A value decodes as  w = decode(code) * scale  (- offset)  in float32 (reference.dequantize_layout). `decode` is
the identity on integers (and E4M3 -> f32: `decode_integer`), a 16-entry code book written as a select tree
(`Table16`: Triton has no gather), or E2M1 built from its bits (`e2m1`).

The contract with a weight format: the format hands over its values in its own row layout, codes [N, K] (one
code per value, N rows of K), scale and offset [N, K/G] already computed in float32 exactly as its own dequantize
computes them, plus a `LayoutSpec`; `to_layout` transposes and packs them (plain jnp, jit-able, one pass over the
bytes). Nothing here knows a format class: the spec and the arrays are the whole interface, so the format stays
responsible for `decode(to_layout(...)) == its dequantize` bit for bit.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def lookup16(code: jax.Array, table: np.ndarray) -> jax.Array:
    """code (integer, values 0..15) -> float32 table[code], as a binary tree of 15 selects (no gather)."""
    vals = [np.float32(v) for v in table]
    for bit in range(4):
        set_ = (code & (1 << bit)) != 0
        vals = [jnp.where(set_, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return jnp.asarray(vals[0], jnp.float32)


def decode_integer(code: jax.Array) -> jax.Array:
    """A code that is its value (int8, uint8, float8): -> float32."""
    return code.astype(jnp.float32)


def e2m1(code: jax.Array) -> jax.Array:
    """E2M1 code (s e e m, values 0..15) -> float32, by building the bf16 bits (cheaper than a 16-way select):
    magnitude code c >= 2 is 2^(c>>1 - 1) * (1 + (c&1)/2), whose bf16 bits are (c << 6) + (126 << 7); c = 1 is
    0.5 (bf16 0x3F00), c = 0 is 0; the sign goes to bit 15. Exact (every E2M1 value is a bf16)."""
    mag = (code & 7).astype(jnp.uint16)
    bits = jnp.where(mag >= 2, (mag << 6) + jnp.uint16(126 << 7), jnp.where(mag == 1, jnp.uint16(0x3F00),
                                                                          jnp.uint16(0)))
    bits = bits | ((code & 8).astype(jnp.uint16) << 12)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Table16:
    """Decode a 4-bit code through a 16-entry code book (float32 values, held as a hashable tuple)."""

    values: tuple[float, ...]

    def __post_init__(self):
        if len(self.values) != 16:
            raise ValueError(f"a 4-bit code book has 16 entries, got {len(self.values)}")

    @classmethod
    def of(cls, table: np.ndarray) -> "Table16":
        return cls(tuple(float(v) for v in np.asarray(table, np.float32)))  # float32 -> float -> float32: exact

    def __call__(self, code: jax.Array) -> jax.Array:
        return lookup16(code, np.asarray(self.values, np.float32))


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """How one format decodes in the kernels. name: the format's name (labels the kernels, keys the tuning
    tables); nibble: two 4-bit codes per byte (else one code per byte); group: values per scale along K (G), 0
    for an unscaled weight (plain_layout: no scale array, the code is the value); has_offset: an offset array is
    subtracted after the scale; decode: code -> float32 (decode_integer, e2m1, a Table16, or another hashable
    jnp function that Triton can lower)."""

    name: str
    nibble: bool
    group: int
    has_offset: bool
    decode: Callable[[jax.Array], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """One layer's weight in the kernel layout (see the module docstring). shape = (K, N), kt the K tile."""

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    spec: LayoutSpec = dataclasses.field(metadata={"static": True})
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    kt: int = dataclasses.field(metadata={"static": True})


def layout_error(spec: LayoutSpec, shape: tuple[int, int], kt: int) -> str | None:
    """Why a [K, N] = shape weight of this spec cannot use the fused kernels with K tile `kt` (None: it can)."""
    k, n = shape
    g = spec.group or 1
    if kt & (kt - 1) or kt < 16 or kt % g or (spec.nibble and (kt // 2) % g):
        return f"{spec.name}: K tile kt={kt} must be a power of 2, >= 16, and a multiple of the block {g} " \
               f"(of 2*{g} for 4-bit codes)"
    if k % kt:
        return f"{spec.name}: K={k} (the input dim) must be a multiple of the K tile kt={kt}"
    if n % 16:
        return f"{spec.name}: N={n} (the output dim) must be a multiple of 16"
    return None


PLAIN = {name: LayoutSpec(name, nibble=False, group=0, has_offset=False, decode=decode_integer)
         for name in ("bfloat16", "float16", "float32")}


def plain_layout(w_kn: jax.Array, kt: int = 128) -> KernelLayout:
    """An unquantised [K, N] weight (bf16 / fp16 / fp32) as a KernelLayout: the codes are the weight itself, no
    scale, so the kernels (the decode form above all) run on plain weights too. No copy is made."""
    k, n = w_kn.shape
    spec = PLAIN[jnp.dtype(w_kn.dtype).name]
    err = layout_error(spec, (k, n), kt)
    if err:
        raise ValueError(err)
    return KernelLayout(codes=w_kn, scale=None, offset=None, spec=spec, shape=(k, n), kt=kt)


def _pair_halves(codes_kn: jax.Array, kt: int) -> jax.Array:
    """uint8 codes [K, N] (0..15) -> [K/2, N] bytes, half-split per K tile of kt rows."""
    k, n = codes_kn.shape
    c = codes_kn.reshape(k // kt, 2, kt // 2, n)
    return (c[:, 0] | (c[:, 1] << 4)).reshape(k // 2, n)


def to_layout(spec: LayoutSpec, codes_nk: jax.Array, scale_nk: jax.Array, offset_nk: jax.Array | None,
              kt: int = 128) -> KernelLayout:
    """A format's values in its row layout -> the KernelLayout with K tile kt (jnp, jit-able).

    codes_nk [N, K]: one code per value (0..15 for nibble specs); scale_nk / offset_nk [N, K/G] (offset None
    unless spec.has_offset). Raises ValueError with the reason when the kernels cannot take the shape."""
    n, k = codes_nk.shape
    err = layout_error(spec, (k, n), kt)
    if err:
        raise ValueError(err)
    if scale_nk.shape != (n, k // spec.group) or (offset_nk is None) == spec.has_offset:
        raise ValueError(f"{spec.name}: scale {scale_nk.shape} / offset "
                         f"{None if offset_nk is None else offset_nk.shape} do not fit codes {codes_nk.shape} "
                         f"with block {spec.group}, has_offset={spec.has_offset}")
    codes = codes_nk.T                                                             # [K, N]
    if spec.nibble:
        codes = _pair_halves(codes.astype(jnp.uint8), kt)
    off = None if offset_nk is None else offset_nk.T.astype(jnp.float32)
    return KernelLayout(codes=codes, scale=scale_nk.T.astype(jnp.float32), offset=off, spec=spec, shape=(k, n),
                        kt=kt)


__all__ = ["KernelLayout", "LayoutSpec", "PLAIN", "Table16", "decode_integer", "e2m1", "layout_error", "lookup16",
           "plain_layout", "to_layout"]
