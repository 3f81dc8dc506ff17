"""Fused dequantise + matmul kernels (Pallas, Triton lowering on GPU; `interpret=True` elsewhere).

    forward     y [M, N]  = x [M, K] @ W [K, N]      grid (M/bm, N/bn), loop over K in tiles of kt
    transposed  dx [M, K] = g [M, N] @ W^T [N, K]    grid (M/bm, K/kt), loop over N in tiles of bn

W arrives in the kernel layout (pallas_kernels.quant_matmul.layout): per K tile the kernel loads the packed codes of a
[kt, bn] tile (a [kt/2, bn] byte tile for 4-bit codes), the [kt/G, bn] scales (and offsets), decodes
w = decode(code) * scale (- offset) in float32 registers, casts to the activation dtype (bf16) and runs the dot
with float32 accumulation. For 4-bit codes the low nibbles are the first half of the K tile and the high nibbles
the second (the layout's half-split), so a tile is two dots and never needs an interleave.

Shapes: M is padded up to the row tile (any M works); K must be a multiple of kt and N of the column tile
(layout_error says why not); the tile sizes must be powers of 2 (Triton). Each program re-decodes its weight
tiles: the decode work is (M / bm) x the weight size, which is why bm should be large (128-256).

Decode (few rows, M <= 64: one token per running sequence) is the other regime: one row tile, and only N / bn
programs, too few to keep 132 SMs reading the weight. `forward(..., splits=S)` splits K as well:

    grid (M/bm, N/bn, S); program (i, j, s) sums K tiles [s K/S, (s+1) K/S) into fp32 partials p [S, M, N]
    y = sum_s p[s]  (one small XLA reduction, fp32, then the cast)

so every weight byte is still read once, by (N/bn) x S programs. `splits_for` picks S.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quant_matmul.layout import KernelLayout, LayoutSpec


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes and Triton launch parameters. bm: rows of x per program; bn: columns of W per program
    (forward) or per loop step (transposed); kt: K per loop step (forward) or per program (transposed) -- it
    is the layout's K tile. num_warps / num_stages: Triton's (None = its default)."""

    bm: int = 128
    bn: int = 128
    kt: int = 128
    num_warps: int | None = 8
    num_stages: int | None = 3
    swap: bool = False  # accumulate the transposed output tile, the decoded W being the dot's LEFT operand

    def label(self) -> str:
        swap = "-swap" if self.swap else ""
        return f"bm{self.bm}-bn{self.bn}-kt{self.kt}-w{self.num_warps}-s{self.num_stages}{swap}"


def _pow2(v: int) -> bool:
    return v > 0 and not v & (v - 1)


def _compiler_params(tiles: Tiles, interpret: bool):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _rows(s: jax.Array, group: int) -> jax.Array:
    """Scales of a tile [r, bn] -> one per row [r * group, bn] (each repeated `group` times)."""
    r, bn = s.shape
    if r == 1:
        return jnp.broadcast_to(s, (group, bn))
    return jnp.broadcast_to(s[:, None, :], (r, group, bn)).reshape(r * group, bn)


def _decode(code, scale, offset, spec: LayoutSpec, dtype):
    """code [R, bn], scale/offset [R/G, bn] -> W tile [R, bn] in dtype (float32 math as the format's)."""
    if not spec.group:                                # unscaled (plain_layout): the code is the value
        return spec.decode(code).astype(dtype)
    w = spec.decode(code) * _rows(scale, spec.group)
    if spec.has_offset:
        w = w - _rows(offset, spec.group)
    return w.astype(dtype)


def _tile(q_ref, s_ref, o_ref, t, cols, spec: LayoutSpec, kt: int, dtype, base=(0, 0)):
    """The decoded W of K tile t: [(w [rows, cols], k offset in the tile)], two halves for 4-bit codes.
    t: the K tile's index in the refs (traced in the forward loop, 0 in the transposed kernel's block);
    cols: pl.ds (or slice) over N; base: the first code row and scale row of the weight in the refs (a layer of
    a stacked weight, `forward(..., layer=)`). Offsets are products of t with static ints (no traced division)."""
    g = spec.group
    parts = 2 if spec.nibble else 1
    rows = kt // parts                                # values (and code rows) per part
    if spec.nibble:
        byte = q_ref[pl.ds(base[0] + t * rows, rows), cols]     # [kt/2, bn] uint8: low nibbles, then high nibbles
        codes = (byte & 0x0F, byte >> 4)
    else:
        codes = (q_ref[pl.ds(base[0] + t * kt, kt), cols],)
    out = []
    for h, code in enumerate(codes):
        if not g:
            out.append((_decode(code, None, None, spec, dtype), h * rows))
            continue
        srows = pl.ds(base[1] + t * (kt // g) + h * (rows // g), rows // g)
        off = o_ref[srows, cols] if spec.has_offset else None
        out.append((_decode(code, s_ref[srows, cols], off, spec, dtype), h * rows))
    return out


def _refs(rest, spec: LayoutSpec):
    """The kernel's refs after x and the codes -> (scale, offset, out); None for what the format lacks."""
    rest = list(rest)
    s_ref = rest.pop(0) if spec.group else None
    o_ref = rest.pop(0) if spec.has_offset else None
    return s_ref, o_ref, rest[0]


def _dot(a, b, contract: tuple[int, int]):
    """a . b contracting dim contract[0] of a with contract[1] of b, fp32 accumulation."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               preferred_element_type=jnp.float32)


def _forward_kernel(x_ref, *refs, spec: LayoutSpec, kt: int, n_k: int, swap: bool, layered: bool = False,
                    code_rows: int = 0, scale_rows: int = 0):
    """y tile [bm, bn] = sum over K tiles of x [bm, kt] @ w [kt, bn]; with swap the accumulator is y^T [bn, bm]
    = w^T @ x^T (on Hopper the left wgmma operand may stay in registers, where the decoded tile is).
    layered: one layer of a stacked weight, read in place: refs start with the layer [1], the weight refs hold
    every layer ([L * code_rows, N], [L * scale_rows, N], whole blocks), and this program's K tiles and
    columns are offset by hand."""
    l_ref, q_ref, *rest = refs if layered else (None, *refs)
    s_ref, o_ref, y_ref = _refs(rest, spec)
    bm, bn = y_ref.shape
    if layered:
        layer, split = l_ref[0], pl.program_id(2)
        base, cols, t0 = (layer * code_rows, layer * scale_rows), pl.ds(pl.program_id(1) * bn, bn), split * n_k
    else:
        base, cols, t0 = (0, 0), slice(None), 0

    def step(t, acc):
        for w, k0 in _tile(q_ref, s_ref, o_ref, t0 + t, cols, spec, kt, x_ref.dtype, base):
            x = x_ref[:, pl.ds(t * kt + k0, w.shape[0])]                   # [bm, rows]
            acc = acc + (_dot(w, x, (0, 1)) if swap else _dot(x, w, (1, 0)))
        return acc

    acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
    y_ref[...] = (acc.T if swap else acc).astype(y_ref.dtype)


def _transposed_kernel(g_ref, q_ref, *rest, spec: LayoutSpec, kt: int, bn: int, n_n: int, swap: bool):
    """dx tile [bm, kt] = sum over N tiles of g [bm, bn] @ w[kt, bn]^T (one accumulator per half of the K tile
    for 4-bit codes); with swap the accumulators are dx^T = w @ g^T, the decoded tile the left operand as is."""
    s_ref, o_ref, dx_ref = _refs(rest, spec)
    bm = dx_ref.shape[0]
    n_parts = 2 if spec.nibble else 1
    width = kt // n_parts

    def step(j, accs):
        cols = pl.ds(j * bn, bn)
        g = g_ref[:, cols]                                                  # [bm, bn]
        parts = _tile(q_ref, s_ref, o_ref, 0, cols, spec, kt, g_ref.dtype)
        return tuple(a + (_dot(w, g, (1, 1)) if swap else _dot(g, w, (1, 1)))
                     for a, (w, _) in zip(accs, parts))                    # [width, bm] / [bm, width] each

    shape = (width, bm) if swap else (bm, width)
    accs = jax.lax.fori_loop(0, n_n, step, tuple(jnp.zeros(shape, jnp.float32) for _ in range(n_parts)))
    for h, a in enumerate(accs):
        dx_ref[:, pl.ds(h * width, width)] = (a.T if swap else a).astype(dx_ref.dtype)


def _check(lw: KernelLayout, tiles: Tiles, n_tile: int):
    k, n = lw.shape
    if tiles.kt != lw.kt:
        raise ValueError(f"tiles.kt={tiles.kt} differs from the layout's K tile {lw.kt}")
    for name, v in (("bm", tiles.bm), ("bn", n_tile)):
        if not _pow2(v) or v < 16:
            raise ValueError(f"tile {name}={v} must be a power of 2 >= 16 (Triton)")
    if n % n_tile:
        raise ValueError(f"{lw.spec.name}: N={n} (the output dim) must be a multiple of the column tile bn={n_tile}")


def fit_tiles(tiles: Tiles, m: int, n: int) -> Tiles:
    """Shrink bm to the (power-of-2) size of a small M and bn to a power-of-2 divisor of N (>= 16)."""
    bm = min(tiles.bm, max(16, 1 << (max(m, 1) - 1).bit_length()))
    bn = tiles.bn
    while bn > 16 and n % bn:
        bn //= 2
    return dataclasses.replace(tiles, bm=bm, bn=bn)


def _pad_rows(a: jax.Array, bm: int) -> jax.Array:
    pad = (-a.shape[0]) % bm
    return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _weight_args(lw: KernelLayout):
    return (lw.codes,) + ((lw.scale,) if lw.spec.group else ()) + ((lw.offset,) if lw.spec.has_offset else ())


def _scale_specs(spec: LayoutSpec, rows: int, cols: int, index) -> list:
    """BlockSpecs of the scale and offset blocks covering `rows` values along K (none for an unscaled spec)."""
    if not spec.group:
        return []
    return [pl.BlockSpec((rows // spec.group, cols), index)] * (2 if spec.has_offset else 1)


def splits_for(m: int, k: int, n: int, tiles: Tiles, programs: int = 264) -> int:
    """K splits S for the forward at M rows: the smallest divisor of the K tile count whose grid
    (row tiles x N/bn x S) reaches `programs` (default two per SM of an H200), else the whole count (one K tile
    per program). 1 when the row and column tiles alone give that many programs (training-sized M)."""
    tiles = fit_tiles(tiles, m, n)
    base = -(-max(m, 1) // tiles.bm) * (n // tiles.bn)
    n_k = k // tiles.kt
    for s in range(1, n_k + 1):
        if n_k % s == 0 and base * s >= programs:
            return s
    return n_k


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "out_dtype", "splits"))
def forward(x: jax.Array, lw: KernelLayout, tiles: Tiles = Tiles(), interpret: bool = False, out_dtype=None,
            splits: int = 1, layer: jax.Array | None = None):
    """y [M, N] = x [M, K] @ W. x in the compute dtype (bf16); y in out_dtype (default x's dtype). splits = S > 1
    splits K over S programs per output tile (fp32 partials, summed after: the decode form, module docstring);
    S must divide the K tile count K / kt. layer (an int32 scalar, traced): lw's arrays are stacked [L, ...] and
    the product is with layer `layer`, read in place (a layer scan hands the kernel the whole stack and its index
    instead of a slice, which XLA would copy out before a custom call: a weight-sized copy per layer)."""
    m, k = x.shape
    kk, n = lw.shape
    if k != kk:
        raise ValueError(f"x has K={k}, the weight {lw.shape}")
    if layer is not None and lw.codes.ndim != 3:
        raise ValueError(f"a layer of a stacked weight needs codes [L, rows, N], got {lw.codes.shape}")
    tiles = fit_tiles(tiles, m, n)
    _check(lw, tiles, tiles.bn)
    bm, bn, kt = tiles.bm, tiles.bn, tiles.kt
    if splits < 1 or (k // kt) % splits:
        raise ValueError(f"splits={splits} must divide the {k // kt} K tiles of K={k} (kt={kt})")
    spec = lw.spec
    xp = _pad_rows(x, bm)
    ks = k // splits                                       # K values per program
    rows = xp.shape[0]
    args = [xp]
    in_specs = [pl.BlockSpec((bm, ks), lambda i, j, s: (i, s))]
    name = f"qmm_{spec.name}_fwd"
    if layer is None:   # this program's K range and columns as blocks
        code_rows = ks // 2 if spec.nibble else ks
        kernel = functools.partial(_forward_kernel, spec=spec, kt=kt, n_k=ks // kt, swap=tiles.swap)
        in_specs += [pl.BlockSpec((code_rows, bn), lambda i, j, s: (s, j))]
        in_specs += _scale_specs(spec, ks, bn, lambda i, j, s: (s, j))
        args += list(_weight_args(lw))
    else:               # the whole stack, [L * rows, N] (a free reshape), offsets taken by hand in the kernel
        kernel = functools.partial(_forward_kernel, spec=spec, kt=kt, n_k=ks // kt, swap=tiles.swap, layered=True,
                                   code_rows=lw.codes.shape[1], scale_rows=k // spec.group if spec.group else 0)
        weights = [a.reshape(-1, a.shape[-1]) for a in _weight_args(lw)]
        in_specs += [pl.BlockSpec((1,), lambda i, j, s: (0,))]
        in_specs += [pl.BlockSpec(a.shape, lambda i, j, s: (0, 0)) for a in weights]
        args += [jnp.reshape(layer, (1,)).astype(jnp.int32)] + weights
        name += "_layer"
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype or x.dtype)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((splits, rows, n), jnp.float32)
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
        name += f"_split{splits}"
    y = pl.pallas_call(kernel, out_shape=out_shape, grid=(rows // bm, n // bn, splits), in_specs=in_specs,
                       out_specs=out_spec, compiler_params=_compiler_params(tiles, interpret), interpret=interpret,
                       name=name)(*args)
    if splits > 1:
        y = y.sum(axis=0).astype(out_dtype or x.dtype)
    return y[:m]


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "out_dtype"))
def transposed(g: jax.Array, lw: KernelLayout, tiles: Tiles = Tiles(), interpret: bool = False, out_dtype=None):
    """dx [M, K] = g [M, N] @ W^T (the input gradient of forward). dx in out_dtype (default g's dtype)."""
    m, n = g.shape
    k, nn = lw.shape
    if n != nn:
        raise ValueError(f"g has N={n}, the weight {lw.shape}")
    tiles = fit_tiles(tiles, m, n)
    _check(lw, tiles, tiles.bn)
    bm, bn, kt = tiles.bm, tiles.bn, tiles.kt
    spec = lw.spec
    gp = _pad_rows(g, bm)
    code_rows = kt // 2 if spec.nibble else kt
    w_specs = [pl.BlockSpec((code_rows, n), lambda i, t: (t, 0))]
    w_specs += _scale_specs(spec, kt, n, lambda i, t: (t, 0))
    dx = pl.pallas_call(
        functools.partial(_transposed_kernel, spec=spec, kt=kt, bn=bn, n_n=n // bn, swap=tiles.swap),
        out_shape=jax.ShapeDtypeStruct((gp.shape[0], k), out_dtype or g.dtype),
        grid=(gp.shape[0] // bm, k // kt),
        in_specs=[pl.BlockSpec((bm, n), lambda i, t: (i, 0))] + w_specs,
        out_specs=pl.BlockSpec((bm, kt), lambda i, t: (i, t)),
        compiler_params=_compiler_params(tiles, interpret),
        interpret=interpret,
        name=f"qmm_{lw.spec.name}_bwd",
    )(gp, *_weight_args(lw))
    return dx[:m]


__all__ = ["Tiles", "fit_tiles", "forward", "splits_for", "transposed"]
