"""The decode GEMV on a quantised weight: y [M, N] = x [M, K] @ decode(W)^T for a few rows (M <= MAX_ROWS), W kept
quantised in a transposed layout ([N, K]-major, K contiguous, `QuantRows`) and decoded in registers, with the
same fused prologue / gated product / residual as the plain kernel (kernel.py, whose FMA body this follows).

    QuantRows  codes [R, K/2] uint8 (4-bit codes, two to a byte) or [R, K] (byte codes), R = N (or L N: a layer
               stack read in place at `layer`); per block of `bk` K values the 4-bit codes are half-split: byte c
               of block t holds value t bk + c in its low nibble and t bk + bk/2 + c in its high nibble, so a
               [bn, bk/2] byte tile unpacks into the two contiguous halves of the block (no interleave)
               scale [R, K/G] float32 (one per G values of a row: the format's block), offset the same (formats
               that subtract one) or None; spec (pallas_kernels.quant_matmul.layout.LayoutSpec: the decode)
    grid (N_out / bn,)   program j owns output columns [j bn, (j+1) bn) of every row
    loop over K blocks t of bk values: per half (one for byte codes) load the [bn, bk/2] code tile and its
               [bn, bk/2G] scales (and offsets), decode w = decode(code) * scale (- offset) in fp32, round to x's
               dtype (the XLA path multiplies the weight dequantised to x's dtype), and for each row
               acc_i [bn] += sum_k w * x_i[k] in fp32

Above MAX_ROWS rows (up to MAX_DOT_ROWS: 16 / 64 users) the tensor-core body (`_qgemv_dot_kernel`, dot_kernel.py's
on the decoded tiles): x [M_pad, bk/2] @ w [bn, bk/2]^T per half-block, acc [M_pad, bn] fp32, rows past M masked.

Bytes: Q4_K's layout is 0.5 + 8 / 32 = 0.75 bytes a value (fp32 scale and offset per 32 values) against bf16's 2:
the one-row product reads ~2.7x fewer bytes, one launch per linear (the split-K fused GEMM's decode form launches
a pad and a partial-sum kernel beside it). Math: the plain kernel's (reference.py) on the decoded weight, whose
values equal the format's own `dequantize` bit for bit (the layout's contract).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_gemv.dot_kernel import MAX_DOT_ROWS, MIN_DOT_BN, PaddedRows
from pallas_kernels.decode_gemv.fused_ops import finish, normalise, operands, rows_rstd
from pallas_kernels.decode_gemv.kernel import ACTIVATIONS, MAX_ROWS, NORMS
from pallas_kernels.quant_matmul.layout import LayoutSpec

MIN_QUANT_BN = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantRows:
    """A quantised weight in the decode GEMV's layout (module docstring). k: the values per row; bk: the K block
    (of the half-split, and the kernel's loop step)."""

    codes: jax.Array
    scale: jax.Array | None
    offset: jax.Array | None
    spec: LayoutSpec = dataclasses.field(metadata={"static": True})
    k: int = dataclasses.field(metadata={"static": True})
    bk: int = dataclasses.field(metadata={"static": True})

    @property
    def rows(self) -> int:
        return self.codes.shape[0]


def layout_error(spec: LayoutSpec, k: int, bk: int) -> str | None:
    """Why rows of k values of `spec` cannot be laid out with K block bk (None: they can)."""
    g = spec.group or 1
    half = bk // 2 if spec.nibble else bk
    if bk & (bk - 1) or bk < 32 or half % g or (half // g) & (half // g - 1):
        return (f"{spec.name}: K block bk={bk} must be a power of 2 >= 32 whose {'half' if spec.nibble else 'block'} "
                f"holds a power-of-2 number of the format's blocks of {g}")
    if k % bk:
        return f"{spec.name}: K={k} (the input dim) must be a multiple of the K block bk={bk}"
    return None


def pack_rows(spec: LayoutSpec, codes_nk: jax.Array, scale_nk: jax.Array | None, offset_nk: jax.Array | None,
              bk: int) -> QuantRows:
    """A format's values in its row layout (codes [..., N, K], one code per value; scale / offset [..., N, K/G]
    float32: `QuantFormat.kernel_values`) -> QuantRows with the leading axes kept (jnp, jit-able)."""
    k = codes_nk.shape[-1]
    err = layout_error(spec, k, bk)
    if err:
        raise ValueError(err)
    codes = codes_nk
    if spec.nibble:
        c = codes_nk.astype(jnp.uint8).reshape(*codes_nk.shape[:-1], k // bk, 2, bk // 2)
        codes = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes_nk.shape[:-1], k // 2)
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    return QuantRows(codes=codes, scale=f32(scale_nk) if spec.group else None, offset=f32(offset_nk), spec=spec,
                     k=k, bk=bk)


def unpack_rows(w: QuantRows) -> jax.Array:
    """QuantRows (arrays [..., R, ·]) -> float32 [..., R, K]: decode(code) * scale (- offset), the kernel's values."""
    spec, k, bk = w.spec, w.k, w.bk
    codes = w.codes
    if spec.nibble:
        c = codes.reshape(*codes.shape[:-1], k // bk, 1, bk // 2)
        codes = jnp.concatenate([c & 0x0F, c >> 4], axis=-2).reshape(*codes.shape[:-1], k)
    v = spec.decode(codes)
    if not spec.group:
        return v
    rep = lambda a: jnp.repeat(a, spec.group, axis=-1)  # noqa: E731
    v = v * rep(w.scale)
    return v - rep(w.offset) if spec.has_offset else v


def _expand(s: jax.Array, bn: int, width: int, group: int) -> jax.Array:
    """Scales of a tile [bn, width / group] -> one per value [bn, width]."""
    r = width // group
    if r == 1:
        return jnp.broadcast_to(s, (bn, width))
    return jnp.broadcast_to(s[:, :, None], (bn, r, group)).reshape(bn, width)


def _decoded(q_ref, s_ref, o_ref, row0, t, *, spec: LayoutSpec, bn: int, bk: int, dt):
    """The weight rows [row0, row0 + bn) on K block t: [(w [bn, width] fp32 holding dt values, first K column)]."""
    f32 = jnp.float32
    width = bk // 2 if spec.nibble else bk
    rows = pl.ds(row0, bn)
    if spec.nibble:
        byte = q_ref[rows, pl.ds(pl.multiple_of(t * width, width), width)]
        codes = (byte & 0x0F, byte >> 4)
    else:
        codes = (q_ref[rows, pl.ds(pl.multiple_of(t * bk, bk), bk)],)
    out = []
    for h, code in enumerate(codes):
        k0 = t * bk + h * width
        w = spec.decode(code)
        if spec.group:
            g = spec.group
            cols = pl.ds(t * (bk // g) + h * (width // g), width // g)
            w = w * _expand(s_ref[rows, cols], bn, width, g)
            if spec.has_offset:
                w = w - _expand(o_ref[rows, cols], bn, width, g)
        out.append((w.astype(dt).astype(f32), k0))
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixedRows:
    """A layer stack whose layers come in different formats (llama.cpp's Q4_K_M: attn_v / ffn_down in Q6_K on some
    layers): one QuantRows stack per format holding its layers, and per layer of the stack its format (`kind`
    [L]) and its index in that format's stack (`pos` [L]). The kernel reads kind[layer] and branches (scf.if in
    the kernel: no host round trip), each branch reading its format's rows in place."""

    parts: tuple[QuantRows, ...]
    kind: jax.Array
    pos: jax.Array

    @property
    def k(self) -> int:
        return self.parts[0].k


def _split_refs(refs, parts: tuple, mixed: bool):
    """The kernel's refs after layer -> (kind, pos, x, [(codes, scale, offset) per part], the rest)."""
    refs = list(refs)
    kind_ref, pos_ref = (refs.pop(0), refs.pop(0)) if mixed else (None, None)
    x_ref = refs.pop(0)
    part_refs = []
    for spec, _ in parts:
        q = refs.pop(0)
        s_ = refs.pop(0) if spec.group else None
        o = refs.pop(0) if spec.has_offset else None
        part_refs.append((q, s_, o))
    return kind_ref, pos_ref, x_ref, part_refs, refs


def _per_format(layer_ref, kind_ref, pos_ref, parts, part_refs, accumulate):
    """accumulate(spec, bk, (codes, scale, offset), this layer's index in that format's stack) -> accs, for this
    layer's format: the one format, or a branch per format on kind[layer]."""
    layer = layer_ref[0]
    if kind_ref is None:
        return accumulate(*parts[0], part_refs[0], layer)
    pos = pos_ref[layer]
    branches = [functools.partial(accumulate, spec, bk, r, pos) for (spec, bk), r in zip(parts, part_refs)]
    return jax.lax.switch(kind_ref[layer], [lambda b=b: b() for b in branches])


def _qgemv_kernel(layer_ref, *refs, parts: tuple, mixed: bool, m: int, n: int, half: int, bn: int, k: int,
                  norm: str | None, eps: float, activation: str | None, residual: bool, round_output: bool):
    """One program: output columns [j bn, (j+1) bn) of the M rows. parts: (spec, bk) per format; n: the weight's
    rows per layer; half: the up rows' offset in a gated weight (0: not gated)."""
    kind_ref, pos_ref, x_ref, part_refs, refs = _split_refs(refs, parts, mixed)
    nw, r_ref, y_ref = operands(refs, norm=norm, residual=residual, k=k)
    dt = x_ref.dtype
    f32 = jnp.float32
    j = pl.program_id(0)
    rstd = rows_rstd(x_ref, m, k, parts[0][1], eps) if norm else [None] * m

    gated = half > 0
    per_row = 2 if gated else 1

    def accumulate(spec, bk, part, index):
        q_ref, s_ref, o_ref = part
        row0 = index * n + j * bn
        width = bk // 2 if spec.nibble else bk
        kw = dict(spec=spec, bn=bn, bk=bk, dt=dt)

        def step(t, accs):
            tiles = _decoded(q_ref, s_ref, o_ref, row0, t, **kw)
            tiles_up = _decoded(q_ref, s_ref, o_ref, row0 + half, t, **kw) if gated else [None] * len(tiles)
            accs = list(accs)
            for h, ((w, k0), up) in enumerate(zip(tiles, tiles_up)):
                cols = pl.ds(pl.multiple_of(k0, width), width)
                nw_t = nw(2 * t + h if spec.nibble else t, width) if norm else None
                for i in range(m):
                    x = x_ref[i, cols]
                    if norm:
                        x = normalise(x, rstd[i], nw_t, norm, dt)
                    x = x.astype(f32)[None, :]
                    a = i * per_row
                    accs[a] = accs[a] + jnp.sum(w * x, axis=1)
                    if gated:
                        accs[a + 1] = accs[a + 1] + jnp.sum(up[0] * x, axis=1)
            return tuple(accs)

        return jax.lax.fori_loop(0, k // bk, step, tuple(jnp.zeros((bn,), f32) for _ in range(m * per_row)))

    accs = _per_format(layer_ref, kind_ref, pos_ref, parts, part_refs, accumulate)
    out_cols = pl.ds(j * bn, bn)
    for i in range(m):
        y = finish(accs[i * per_row], accs[i * per_row + 1] if gated else None,
                   r_ref[i, out_cols] if residual else None, activation=activation, dt=dt, round_output=round_output)
        y_ref[i, out_cols] = y.astype(y_ref.dtype)


def _qgemv_dot_kernel(layer_ref, *refs, parts: tuple, mixed: bool, m: int, n: int, half: int, bn: int, k: int,
                      norm: str | None, eps: float, activation: str | None, residual: bool, round_output: bool):
    """The tensor-core body (dot_kernel.py's, on decoded tiles): x [M_pad, width] @ w [bn, width]^T per half-block,
    acc [M_pad, bn] fp32, the rows past M loaded as 0 and not stored."""
    kind_ref, pos_ref, x_ref, part_refs, refs = _split_refs(refs, parts, mixed)
    nw, r_ref, y_ref = operands(refs, norm=norm, residual=residual, k=k)
    dt = x_ref.dtype
    f32 = jnp.float32
    tile = PaddedRows(m)
    j = pl.program_id(0)
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    rstd = tile.rstd(x_ref, k, parts[0][1], eps) if norm else None

    def dot(x, w):  # x [M_pad, width] @ w [bn, width]^T -> [M_pad, bn] fp32
        return jax.lax.dot_general(x, w.astype(dt), (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=f32)

    gated = half > 0

    def accumulate(spec, bk, part, index):
        q_ref, s_ref, o_ref = part
        row0 = index * n + j * bn
        width = bk // 2 if spec.nibble else bk
        kw = dict(spec=spec, bn=bn, bk=bk, dt=dt)

        def step(t, accs):
            tiles = _decoded(q_ref, s_ref, o_ref, row0, t, **kw)
            tiles_up = _decoded(q_ref, s_ref, o_ref, row0 + half, t, **kw) if gated else [None] * len(tiles)
            for h, ((w, k0), up) in enumerate(zip(tiles, tiles_up)):
                x = tile.load(x_ref, pl.ds(pl.multiple_of(k0, width), width))
                if norm:
                    x = normalise(x, rstd, nw(2 * t + h if spec.nibble else t, width), norm, dt)
                accs = (accs[0] + dot(x, w),) + ((accs[1] + dot(x, up[0]),) if gated else ())
            return accs

        return jax.lax.fori_loop(0, k // bk, step, tuple(jnp.zeros((tile.m_pad, bn), f32) for _ in range(1 + gated)))

    accs = _per_format(layer_ref, kind_ref, pos_ref, parts, part_refs, accumulate)
    out_cols = pl.ds(j * bn, bn)
    r = tile.load(r_ref, out_cols) if residual else None
    y = finish(accs[0], accs[1] if gated else None, r, activation=activation, dt=dt, round_output=round_output)
    tile.store(y_ref, out_cols, y.astype(y_ref.dtype))


@functools.partial(jax.jit, static_argnames=("n", "bn", "num_warps", "num_stages", "norm", "eps", "activation",
                                             "interpret", "out_dtype"))
def quant_gemv(x: jax.Array, w: QuantRows | MixedRows, layer: jax.Array, norm_weight: jax.Array | None = None,
               residual: jax.Array | None = None, norm_row: jax.Array | None = None, *, n: int, bn: int,
               num_warps: int = 4, num_stages: int = 3, norm: str | None = None, eps: float = 1e-6,
               activation: str | None = None, interpret: bool = False, out_dtype=None) -> jax.Array:
    """y [M, N_out] in x's dtype (out_dtype float32: a plain GEMV's fp32 sums unrounded). x [M, K], M <= MAX_DOT_ROWS
    (the FMA body up to MAX_ROWS rows, the tensor-core body above, bn >= MIN_DOT_BN there);
    w QuantRows of R rows holding layer `layer` ([1] int32) in rows [layer n, (layer + 1) n), or MixedRows (layer
    `layer` of the stack in its format's rows at pos[layer]); norm_weight [K] (or [R', K] at `norm_row`), residual
    [M, N_out], activation (a joined [gate; up] weight: N_out = n / 2) as kernel.gemv takes them. bn: output
    columns per program (a power of 2 >= MIN_QUANT_BN dividing N_out)."""
    m, k = x.shape
    mixed = isinstance(w, MixedRows)
    parts = w.parts if mixed else (w,)
    if not 1 <= m <= MAX_DOT_ROWS:
        raise ValueError(f"quantised decode GEMV: {m} rows, the kernel takes 1..{MAX_DOT_ROWS}")
    use_dot = m > MAX_ROWS
    for part in parts:
        if part.k != k or part.rows % n:
            raise ValueError(f"quantised decode GEMV: x [{m}, {k}] against {part.rows} rows of K={part.k} ({n} per "
                             "layer)")
        err = layout_error(part.spec, k, part.bk)
        if err:
            raise ValueError(f"quantised decode GEMV: {err}")
    if norm is not None and norm not in NORMS:
        raise ValueError(f"quantised decode GEMV: norm {norm!r}, expected one of {NORMS}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"quantised decode GEMV: activation {activation!r}, expected one of {ACTIVATIONS}")
    if (norm is None) != (norm_weight is None):
        raise ValueError("quantised decode GEMV: norm and norm_weight come together")
    gated = activation is not None
    n_out = n // 2 if gated else n
    least = MIN_DOT_BN if use_dot else MIN_QUANT_BN
    if bn < least or bn & (bn - 1) or n_out % bn:
        raise ValueError(f"quantised decode GEMV: bn={bn} must be a power of 2 >= {least} dividing the output width "
                         f"{n_out}{' (the tensor-core body)' if use_dot else ''}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype != x.dtype and (out_dtype != jnp.float32 or gated or residual is not None):
        raise ValueError(f"quantised decode GEMV: out_dtype {out_dtype.name}: only float32, for a plain GEMV")
    if residual is not None and residual.shape != (m, n_out):
        raise ValueError(f"quantised decode GEMV: residual {residual.shape}, expected {(m, n_out)}")
    kernel = functools.partial(_qgemv_dot_kernel if use_dot else _qgemv_kernel,
                               parts=tuple((p.spec, p.bk) for p in parts), mixed=mixed, m=m, n=n,
                               half=n_out if gated else 0, bn=bn, k=k, norm=norm, eps=float(eps),
                               activation=activation, residual=residual is not None,
                               round_output=out_dtype == x.dtype)
    args = [jnp.reshape(layer, (1,)).astype(jnp.int32)]
    args += [w.kind.astype(jnp.int32), w.pos.astype(jnp.int32)] if mixed else []
    args += [x]
    for p in parts:
        args += [p.codes] + ([p.scale] if p.spec.group else []) + ([p.offset] if p.spec.has_offset else [])
    if norm is not None:
        args += [norm_weight.reshape(-1), jnp.reshape(0 if norm_row is None else norm_row, (1,)).astype(jnp.int32)]
    args += [residual] if residual is not None else []
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    name = f"decode_qgemv{'_dot' if use_dot else ''}_{'+'.join(p.spec.name for p in parts)}" + \
        (f"_{norm}" if norm else "") + (f"_{activation}" if gated else "") + ("_res" if residual is not None else "")
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype), grid=(n_out // bn,),
                          compiler_params=params, interpret=interpret, name=name)(*args)


__all__ = ["MIN_QUANT_BN", "MixedRows", "QuantRows", "layout_error", "pack_rows", "quant_gemv", "unpack_rows"]
