"""The decode GEMV: y [M, N] = x [M, K] @ W^T for a few rows (M <= MAX_ROWS, one token per running sequence), W
stored TRANSPOSED, [N, K] with K contiguous (laid out once at load), one Pallas kernel (Triton lowering on GPU,
`interpret=True` elsewhere), no second kernel.

    grid (N_out / bn,)   program j owns output columns [j bn, (j+1) bn) of every row
    loop over K in steps of bk: load the weight tile w [bn, bk] (contiguous rows: bn runs of bk values),
                          and for each of the M rows  acc_i [bn] += sum_k w * x_i[k]   (fp32 products and sums)
                          (tiles.deferred: acc_i [bn, bk] += w * x_i, summed over bk once after the loop)
    epilogue: acc cast to x's dtype, then the optional gated product and residual add, stored (out_dtype float32,
              a plain GEMV only: the fp32 sums stored as they are, e.g. a tied LM head's logits)

Why this shape. At M <= 8 the product is bound by the weight's bytes: every weight value is read once, by one
program, and used M times from registers. The quant_matmul kernel's decode form reads W [K, N] in [kt, bn] tiles
through a 16-row dot (M padded to 16) and splits K over programs with an fp32 partial sum in a second (XLA)
kernel; here there is no dot (a [bn, bk] tile times a row and a row sum: FMA work M x the weight, nothing
wasted on padding rows), no pad of x and no partial-sum kernel: one launch per linear.

Fused around it (all optional, static):
    prologue  RMSNorm of x with the norm weight: each program recomputes its rows' sum of squares over the whole K
              (x is a few KB, read from L2), then normalises every x chunk as it is loaded; `norm` = "plain"
              (scale.astype(dt) * normed.astype(dt), Llama / Qwen) or "zero_centered" ((normed * (1 + w)) in
              fp32, then dt: Gemma / Qwen3.5)
    gated     the weight is a joined [gate; up] [2F, K]: program j reads gate rows j bn.. and up rows F + j bn..,
              and stores act(gate) * up [M, F] (act = silu: SwiGLU, gelu_tanh: GeGLU), the MLP's down GEMV input
    residual  y + r, r [M, N_out] in dt (the block's residual stream)

The roundings follow reference.py (the decoder's own ops): the norm's output, the GEMV's output, each op of the
activation (as jax.nn writes it) and the product are rounded to dt, as XLA rounds each op's output.

Stacked weights are read in place: W may be a layer stack [L N, K] (a [L, N, K] stack reshaped for free) with
the layer index an int32 [1] operand; the program offsets its rows by layer x N (a sliced operand would be copied
out of the stack by XLA before the custom call, a weight-sized copy per layer and token).

Shapes: bn and bk are powers of 2 (Triton); N_out must be a multiple of bn and K of bk (`fit` shrinks them to
divisors; `shape_error` names what cannot be tiled). M is any 1..MAX_ROWS (rows are a static loop).

tiles.dot: the tensor-core body instead (dot_kernel.py: acc [M_pad, bn] += x [M_pad, bk] @ w^T per K step, M up to
MAX_DOT_ROWS, padded to a power of 2 >= 16 in the kernel; bn >= 16), with the same fused forms and roundings.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_gemv.dot_kernel import MAX_DOT_ROWS, MIN_DOT_BN, gemv_dot_kernel
from pallas_kernels.decode_gemv.fused_ops import finish, normalise, operands, rows_rstd

MAX_ROWS = 8          # rows per call: the rows are unrolled, each keeps bn fp32 accumulators (two when gated)
NORMS = ("plain", "zero_centered")
ACTIVATIONS = ("silu", "gelu_tanh")
MIN_BN, MIN_BK = 4, 32


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    """bn: output columns per program; bk: K values per loop step (the weight tile is [bn, bk]); Triton's
    num_warps / num_stages. deferred: each row accumulates the [bn, bk] products elementwise and sums over bk once
    after the loop (no cross-thread reduction per step), where the accumulators fit DEFERRED_REGISTERS fp32
    registers per thread (`deferred_for`); else the sum over bk is taken every step. dot: the tensor-core body
    (dot_kernel.py; up to MAX_DOT_ROWS rows, bn >= MIN_DOT_BN; `deferred` does not apply)."""

    bn: int = 16
    bk: int = 512
    num_warps: int = 4
    num_stages: int = 3
    deferred: bool = False
    dot: bool = False

    def label(self) -> str:
        form = "-dot" if self.dot else "-defer" if self.deferred else ""
        return f"bn{self.bn}-bk{self.bk}-w{self.num_warps}-s{self.num_stages}{form}"

    def max_rows(self) -> int:
        """The most rows one call of this body takes."""
        return MAX_DOT_ROWS if self.dot else MAX_ROWS

    def min_bn(self) -> int:
        return MIN_DOT_BN if self.dot else MIN_BN


DEFERRED_REGISTERS = 64


def deferred_for(tiles: GemvTiles, accumulators: int) -> bool:
    """Whether `accumulators` [bn, bk] fp32 accumulators (rows x 1 or 2) fit the deferred sum's register budget."""
    return (tiles.deferred and not tiles.dot
            and accumulators * tiles.bn * tiles.bk <= DEFERRED_REGISTERS * 32 * tiles.num_warps)


def _pow2(v: int) -> bool:
    return v > 0 and not v & (v - 1)


def _fit(size: int, block: int, least: int) -> int:
    """The largest power of 2 <= block dividing size (0 when none >= least does)."""
    b = block
    while b >= least and size % b:
        b //= 2
    return b if b >= least else 0


def fit(tiles: GemvTiles, n_out: int, k: int) -> GemvTiles:
    """tiles with bn and bk shrunk to power-of-2 divisors of N_out and K (unchanged where they divide)."""
    least = tiles.min_bn()
    return dataclasses.replace(tiles, bn=_fit(n_out, max(tiles.bn, least), least) or tiles.bn,
                               bk=_fit(k, min(tiles.bk, 1 << (k.bit_length() - 1)), MIN_BK) or tiles.bk)


def shape_error(n: int, k: int, gated: bool = False, tiles: GemvTiles = GemvTiles()) -> str | None:
    """Why a weight [N, K] cannot take the kernel (None: it can)."""
    if not (_pow2(tiles.bn) and _pow2(tiles.bk)):
        return f"decode GEMV tiles {tiles.label()}: bn and bk must be powers of 2 (Triton)"
    if gated and n % 2:
        return f"decode GEMV: a gated (joined gate/up) weight needs an even N, got [{n}, {k}]"
    n_out = n // 2 if gated else n
    least = tiles.min_bn()
    if not _fit(n_out, max(tiles.bn, least), least):
        return (f"decode GEMV: the output width {n_out} of weight [{n}, {k}] is not a multiple of {least} "
                f"(the smallest column block{' of the dot body' if tiles.dot else ''})")
    if not _fit(k, min(tiles.bk, 1 << (k.bit_length() - 1)), MIN_BK):
        return f"decode GEMV: K={k} of weight [{n}, {k}] is not a multiple of {MIN_BK} (the smallest K block)"
    return None


def _gemv_kernel(layer_ref, x_ref, w_ref, *refs, m: int, n: int, half: int, bn: int, bk: int, n_k: int,
                 norm: str | None, eps: float, activation: str | None, residual: bool, deferred: bool,
                 round_output: bool = True):
    """One program: output columns [j bn, (j+1) bn) of the M rows (module docstring). n: the weight's rows per
    layer (its N); half: the up rows' offset in a gated weight (0: not gated)."""
    k_total = n_k * bk
    nw, r_ref, y_ref = operands(refs, norm=norm, residual=residual, k=k_total)
    dt = x_ref.dtype
    f32 = jnp.float32
    j = pl.program_id(0)
    row0 = layer_ref[0] * n + j * bn

    rstd = rows_rstd(x_ref, m, k_total, bk, eps) if norm else [None] * m

    def row(i, cols, nw_t):
        """Row i of x on K columns `cols`, normalised by the prologue if any (nw_t: the norm weight there), in fp32
        (its dt value)."""
        x = x_ref[i, cols]
        if norm:
            x = normalise(x, rstd[i], nw_t, norm, dt)
        return x.astype(f32)[None, :]

    gated = half > 0

    def step(t, accs):
        cols = pl.ds(pl.multiple_of(t * bk, bk), bk)
        w = w_ref[pl.ds(row0, bn), cols].astype(f32)                    # [bn, bk]
        wu = w_ref[pl.ds(row0 + half, bn), cols].astype(f32) if gated else None
        out = []
        reduce = (lambda p: p) if deferred else (lambda p: jnp.sum(p, axis=1))  # noqa: E731
        nw_t = nw(t, bk) if norm else None
        for i in range(m):
            x = row(i, cols, nw_t)
            out.append(accs[len(out)] + reduce(w * x))
            if gated:
                out.append(accs[len(out)] + reduce(wu * x))
        return tuple(out)

    per_row = 2 if gated else 1
    shape = (bn, bk) if deferred else (bn,)
    accs = jax.lax.fori_loop(0, n_k, step, tuple(jnp.zeros(shape, f32) for _ in range(m * per_row)))
    if deferred:
        accs = tuple(jnp.sum(a, axis=1) for a in accs)
    out_cols = pl.ds(j * bn, bn)
    for i in range(m):
        y = finish(accs[i * per_row], accs[i * per_row + 1] if gated else None,
                   r_ref[i, out_cols] if residual else None, activation=activation, dt=dt, round_output=round_output)
        y_ref[i, out_cols] = y.astype(y_ref.dtype)


def _compiler_params(tiles: GemvTiles, interpret: bool):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


@functools.partial(jax.jit, static_argnames=("n", "tiles", "norm", "eps", "activation", "interpret", "out_dtype"))
def gemv(x: jax.Array, w: jax.Array, layer: jax.Array, norm_weight: jax.Array | None = None,
         residual: jax.Array | None = None, norm_row: jax.Array | None = None, *, n: int, tiles: GemvTiles,
         norm: str | None = None, eps: float = 1e-6, activation: str | None = None, interpret: bool = False,
         out_dtype=None) -> jax.Array:
    """y [M, N_out] in x's dtype (out_dtype float32: the fp32 sums unrounded, no activation or residual). x [M, K]
    (M <= tiles.max_rows()); w [R, K] holding layer `layer` ([1] int32) in rows [layer n, (layer + 1) n) (R = n
    for one weight); norm_weight [K], or [R', K] read at row `norm_row` ([] int32: a stack's layer, read in place),
    with `norm`; residual [M, N_out]; activation: the weight is a joined [gate; up] (N_out = n / 2). tiles must fit
    (`fit`, `shape_error`)."""
    m, k = x.shape
    if not 1 <= m <= tiles.max_rows():
        raise ValueError(f"decode GEMV: {m} rows, the {'dot' if tiles.dot else 'FMA'} kernel takes "
                         f"1..{tiles.max_rows()}")
    if w.shape[1] != k or w.shape[0] % n:
        raise ValueError(f"decode GEMV: x [{m}, {k}] against weight rows {w.shape} of {n} per layer")
    if norm is not None and norm not in NORMS:
        raise ValueError(f"decode GEMV: norm {norm!r}, expected one of {NORMS}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"decode GEMV: activation {activation!r}, expected one of {ACTIVATIONS}")
    if (norm is None) != (norm_weight is None):
        raise ValueError("decode GEMV: norm and norm_weight come together")
    if norm_weight is not None and (norm_weight.shape[-1] != k or norm_weight.ndim not in (1, 2)
                                    or (norm_weight.ndim == 2) != (norm_row is not None)):
        raise ValueError(f"decode GEMV: norm weight {norm_weight.shape} (row {norm_row}) for K={k}: expected [K], or "
                         "[L, K] with the row to read")
    gated = activation is not None
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype != x.dtype and (out_dtype != jnp.float32 or gated or residual is not None):
        raise ValueError(f"decode GEMV: out_dtype {out_dtype.name} for x in {jnp.dtype(x.dtype).name}: only float32, "
                         "and only for a plain GEMV (no activation, no residual)")
    err = shape_error(n, k, gated, tiles)
    if err:
        raise ValueError(err)
    n_out = n // 2 if gated else n
    bn, bk = tiles.bn, tiles.bk
    if n_out % bn or k % bk:
        raise ValueError(f"decode GEMV: tiles {tiles.label()} do not divide N_out={n_out}, K={k} (use fit)")
    if residual is not None and residual.shape != (m, n_out):
        raise ValueError(f"decode GEMV: residual {residual.shape}, expected {(m, n_out)}")
    common = dict(m=m, n=n, half=n_out if gated else 0, bn=bn, bk=bk, n_k=k // bk, norm=norm, eps=float(eps),
                  activation=activation, residual=residual is not None, round_output=out_dtype == x.dtype)
    if tiles.dot:
        kernel = functools.partial(gemv_dot_kernel, **common)
    else:
        kernel = functools.partial(_gemv_kernel, deferred=deferred_for(tiles, m * (2 if gated else 1)), **common)
    args = [jnp.reshape(layer, (1,)).astype(jnp.int32), x, w]
    if norm is not None:
        args += [norm_weight.reshape(-1), jnp.reshape(0 if norm_row is None else norm_row, (1,)).astype(jnp.int32)]
    args += [residual] if residual is not None else []
    name = "decode_gemv" + ("_dot" if tiles.dot else "") + (f"_{norm}" if norm else "") + \
        (f"_{activation}" if gated else "") + ("_res" if residual is not None else "")
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype), grid=(n_out // bn,),
                          compiler_params=_compiler_params(tiles, interpret), interpret=interpret,
                          name=name)(*args)


__all__ = ["ACTIVATIONS", "DEFERRED_REGISTERS", "MAX_DOT_ROWS", "MAX_ROWS", "NORMS", "GemvTiles", "deferred_for", "fit",
           "gemv", "shape_error"]
