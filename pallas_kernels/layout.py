"""The kernel layout: one quantised [K, N] weight re-laid out so that a [kt, bn] tile of the GEMM is a block of
rows of every array (K on the row axis, N contiguous), with the format's byte semantics unchanged.

    codes   [K/2, N] uint8   "nibble" formats (Q4_K, NF4, NVFP4): two 4-bit codes per byte, half-split per K
                             tile of `kt` rows: byte row t*kt/2 + r holds value k = t*kt + r in its LOW nibble and
                             k = t*kt + kt/2 + r in its HIGH nibble, so a kernel unpacks a [kt/2, bn] byte tile
                             into the two contiguous halves of its K tile (two dots, no interleave)
            [K, N]   uint8 / int8 / float8_e4m3fn   "byte" formats (Q5_K codes 0..31, Q6_K q-32, Q8_0, FP8)
    scale   [K/G, N] float32 one scale per G consecutive values of a column (G = the format's block along K)
    offset  [K/G, N] float32 the subtracted minimum (Q4_K, Q5_K: dmin * m), else None

A value decodes as  w = decode(code) * scale  (- offset)  in float32, the same operations in the same order as the
format's `dequantize`, so `dequantize_layout(to_layout(w)) == w.dequantize(float32)` bit for bit (tested).
`decode` is the identity on integers (and E4M3 -> f32), NF4's 16-entry table written as a select tree
(`lookup16`, Triton has no gather), and E2M1 built from its bits (`e2m1`).

The conversion is plain jnp (jit-able, cheap: one pass over the packed bytes) and runs per call inside the fused
matmul; the stored weight stays in its own format (the GGUF / bnb / ModelOpt bytes).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from surojax.quant import FP8Block, NF4, NVFP4, Q4_K, Q5_K, Q6_K, Q8_0
from surojax.quant.base import QuantFormat, f16_from_bytes
from surojax.quant.nf4 import NF4_CODE


def lookup16(code: jax.Array, table: np.ndarray) -> jax.Array:
    """code (integer, values 0..15) -> float32 table[code], as a binary tree of 15 selects (no gather)."""
    vals = [np.float32(v) for v in table]
    for bit in range(4):
        set_ = (code & (1 << bit)) != 0
        vals = [jnp.where(set_, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return jnp.asarray(vals[0], jnp.float32)


def _as_f32(code: jax.Array) -> jax.Array:
    return code.astype(jnp.float32)


def _nf4(code: jax.Array) -> jax.Array:
    return lookup16(code, NF4_CODE)


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
class Spec:
    """How one format decodes in the kernel: code packing, scale block G along K, decode, whether an offset."""

    nibble: bool
    group: int
    decode: Callable[[jax.Array], jax.Array]
    has_offset: bool


SPECS: dict[str, Spec] = {
    "q4_k": Spec(True, 32, _as_f32, True),
    "q5_k": Spec(False, 32, _as_f32, True),
    "q6_k": Spec(False, 16, _as_f32, False),
    "q8_0": Spec(False, 32, _as_f32, False),
    "nf4": Spec(True, 64, _nf4, False),
    "nvfp4": Spec(True, 16, e2m1, False),
    "fp8": Spec(False, 128, _as_f32, False),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """One layer's weight in the kernel layout (see the module docstring). shape = (K, N), kt the K tile."""

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    fmt: str = dataclasses.field(metadata={"static": True})
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    kt: int = dataclasses.field(metadata={"static": True})

    @property
    def spec(self) -> Spec:
        return SPECS[self.fmt]


def layout_error(w: QuantFormat, kt: int) -> str | None:
    """Why `w` cannot use the fused kernels with K tile `kt` (None when it can)."""
    name = getattr(w, "name", type(w).__name__)
    if name not in SPECS:
        return f"no fused kernel for format {name!r} (have: {', '.join(SPECS)})"
    k, n = w.shape
    lead = jax.tree.leaves(w)[0].ndim - (1 if name == "nf4" else 2)
    if lead:
        return (f"{name}: the fused kernel takes one layer's weight; this one has {lead} leading (stacked) axes "
                "(the decoder's scan slices them off)")
    g = SPECS[name].group
    if kt & (kt - 1) or kt < 16 or kt % g or (SPECS[name].nibble and (kt // 2) % g):
        return f"{name}: K tile kt={kt} must be a power of 2, >= 16, and a multiple of the block {g} (of 2*{g} " \
               "for 4-bit codes)"
    if k % kt:
        return f"{name}: K={k} (the input dim) must be a multiple of the K tile kt={kt}"
    if n % 16:
        return f"{name}: N={n} (the output dim) must be a multiple of 16"
    return None


def _pair_halves(codes_kn: jax.Array, kt: int) -> jax.Array:
    """uint8 codes [K, N] (0..15) -> [K/2, N] bytes, half-split per K tile of kt rows."""
    k, n = codes_kn.shape
    c = codes_kn.reshape(k // kt, 2, kt // 2, n)
    return (c[:, 0] | (c[:, 1] << 4)).reshape(k // 2, n)


def _kq_blocks(w) -> tuple[jax.Array, int]:
    k, n = w.shape
    return jnp.asarray(w.data).reshape(n, k // w.block_size, w.type_size), n


def _q4_k(w: Q4_K):
    from surojax.quant.gguf_kquants import _scale_min_k4

    b, n = _kq_blocks(w)
    nb = b.shape[1]
    d, dmin = f16_from_bytes(b[..., 0:2])[..., None], f16_from_bytes(b[..., 2:4])[..., None]
    sc, m = (a.reshape(n, nb, 8) for a in _scale_min_k4(b[..., 4:16].reshape(-1, 12)))
    scale = (d * sc.astype(jnp.float32)).reshape(n, -1)         # [N, K/32]: sub-block 2i + s
    offset = (dmin * m.astype(jnp.float32)).reshape(n, -1)
    qs = b[..., 16:].reshape(n, nb, 4, 1, 32)                   # byte 32*i + l: sub-blocks 2i (lo), 2i+1 (hi)
    codes = ((qs >> jnp.asarray([0, 4], jnp.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(n, -1)
    return codes, scale, offset


def _q5_k(w: Q5_K):
    from surojax.quant.gguf_kquants import _scale_min_k4

    b, n = _kq_blocks(w)
    nb = b.shape[1]
    d, dmin = f16_from_bytes(b[..., 0:2])[..., None], f16_from_bytes(b[..., 2:4])[..., None]
    sc, m = (a.reshape(n, nb, 8) for a in _scale_min_k4(b[..., 4:16].reshape(-1, 12)))
    scale = (d * sc.astype(jnp.float32)).reshape(n, -1)
    offset = (dmin * m.astype(jnp.float32)).reshape(n, -1)
    qs = b[..., 48:].reshape(n, nb, 4, 1, 32)
    lo = (qs >> jnp.asarray([0, 4], jnp.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F   # [n, nb, 4, 2, 32]
    qh = b[..., 16:48].reshape(n, nb, 1, 32)                                       # bit j of qh[l]: sub-block j
    hi = (qh >> jnp.arange(8, dtype=jnp.uint8).reshape(1, 1, 8, 1)) & 1            # [n, nb, 8, 32]
    codes = (lo.reshape(n, nb, 8, 32) | (hi << 4)).reshape(n, -1)
    return codes, scale, offset


def _q6_k(w: Q6_K):
    b, n = _kq_blocks(w)
    nb = b.shape[1]
    ql, qh = b[..., :128].reshape(n, nb, 2, 1, 64), b[..., 128:192].reshape(n, nb, 2, 1, 32)
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    scale = (f16_from_bytes(b[..., 208:210])[..., None] * sc).reshape(n, -1)      # [N, K/16]
    lo = (ql >> jnp.asarray([0, 4], jnp.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F     # [n, nb, 2, 2, 64]
    hi = (qh >> jnp.asarray([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 1, 4, 1)) & 0x03  # [n, nb, 2, 4, 32]
    q = (lo.reshape(n, nb, 256) | (hi.reshape(n, nb, 256) << 4)).astype(jnp.int32) - 32
    return q.astype(jnp.int8).reshape(n, -1), scale, None


def _q8_0(w: Q8_0):
    b, n = _kq_blocks(w)
    scale = f16_from_bytes(b[..., 0:2]).reshape(n, -1)                             # [N, K/32]
    q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).reshape(n, -1)
    return q, scale, None


def _nf4_codes(w: NF4):
    k, n = w.shape
    data = jnp.asarray(w.data)
    codes = jnp.stack([data >> 4, data & 0x0F], axis=-1).reshape(n, k)             # first value = high nibble
    return codes, w.block_absmax().reshape(n, k // 64), None


def _nvfp4(w: NVFP4):
    k, n = w.shape
    data = jnp.asarray(w.data)
    codes = jnp.stack([data & 0x0F, data >> 4], axis=-1).reshape(n, k)             # even value = low nibble
    eff = jnp.asarray(w.scale).astype(jnp.float32) * jnp.asarray(w.global_scale)
    return codes, eff, None


def _fp8(w: FP8Block):
    k, n = w.shape
    scale = jnp.repeat(jnp.asarray(w.scale), 128, axis=0)[:n]                      # [N, ceil(K/128)]
    return jnp.asarray(w.data), scale, None


_CONVERT = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "q8_0": _q8_0, "nf4": _nf4_codes, "nvfp4": _nvfp4,
            "fp8": _fp8}


def to_layout(w: QuantFormat, kt: int = 128) -> KernelLayout:
    """One layer's quantised weight -> its KernelLayout with K tile kt (jnp, jit-able). Raises ValueError with
    the reason when the fused kernels cannot take it (see layout_error)."""
    err = layout_error(w, kt)
    if err:
        raise ValueError(err)
    name = w.name
    codes_nk, scale_nk, offset_nk = _CONVERT[name](w)
    codes = codes_nk.T                                                             # [K, N]
    if SPECS[name].nibble:
        codes = _pair_halves(codes.astype(jnp.uint8), kt)
    off = None if offset_nk is None else offset_nk.T.astype(jnp.float32)
    return KernelLayout(codes=codes, scale=scale_nk.T.astype(jnp.float32), offset=off, fmt=name,
                        shape=tuple(w.shape), kt=kt)


def dequantize_layout(lw: KernelLayout) -> jax.Array:
    """KernelLayout -> float32 [K, N], by the same decode the kernels apply per tile (the layout's reference)."""
    k, n = lw.shape
    spec = lw.spec
    codes = lw.codes
    if spec.nibble:
        c = codes.reshape(k // lw.kt, 1, lw.kt // 2, n)
        codes = jnp.concatenate([c & 0x0F, c >> 4], axis=1).reshape(k, n)
    rows = lambda a: jnp.repeat(a, spec.group, axis=0)  # noqa: E731  [K/G, N] -> [K, N]
    w = spec.decode(codes) * rows(lw.scale)
    if spec.has_offset:
        w = w - rows(lw.offset)
    return w


__all__ = ["KernelLayout", "SPECS", "Spec", "dequantize_layout", "e2m1", "layout_error", "lookup16", "to_layout"]
