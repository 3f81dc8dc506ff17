"""`decode_gemv(x, wt, ...)`: the decode GEMV (kernel.py) for a caller's few rows, and the choice between it and XLA.

    x [..., K] with M = prod(leading) <= MAX_DOT_ROWS rows; wt [N, K] (the weight TRANSPOSED, K contiguous), or a
    layer stack [L, N, K] read in place at `layer`; optional RMSNorm prologue (`norm_weight` [K], or a stack [L, K]
    read in place at `norm_layer`; `norm` = plain | zero_centered, `eps`), gated product (`activation` = silu |
    gelu_tanh: wt is a joined [gate; up]) and residual (`residual` [..., N_out]) -> [..., N_out] in x's dtype.

Two bodies (GemvTiles.dot): the FMA rows (kernel.py, M <= MAX_ROWS = 8) and the tensor-core tile (dot_kernel.py,
M <= MAX_DOT_ROWS = 64, padded to a power of 2 >= 16 in the kernel). The default tiles take the dot body from
DOT_FROM_M rows (9: wherever the FMA body cannot; lower it where the GPU measures the dot faster at few rows).

Mode (the caller's; surojax passes SUROJAX_DECODE_GEMV from its kernel settings, this package reads no
environment): auto | pallas | xla.
    pallas  the kernel for every call of M <= MAX_DOT_ROWS (interpret mode off a GPU: slow, for tests)
    xla     never
    auto    the kernel on a GPU for M <= AUTO_MAX_M (8 = MAX_ROWS: measured on an H100 in session 23, the engine
            at one user on Qwen3-0.6B shapes decodes 655 tok/s with the kernel against 468 with XLA, and the 16 / 64
            user rows, whose calls of more rows take XLA on the transposed weight, stay at 1.05x / 1.04x llama.cpp
            in the same job: RESULTS.md), and for MAX_ROWS < M <= AUTO_DOT_MAX_M (the dot body, 64: measured on an
            H100 in session 29, the engine on Qwen3-8B shapes decodes 1,411 / 3,909 tok/s at 16 / 64 users with it
            against 903 / 2,823 with XLA, whose einsum on the layer sliced out of the stack copies the weight
            first: every step copied all 16 GB)
`converts(mode)` says whether a server should lay its plain weights out transposed for the kernel at load
(surojax.quant.gemv_weight); `choose(m, mode)` which path a call of m rows takes.

Quantised weights (quant_kernel.py: `QuantRows`, decoded in registers, the same fused forms, the FMA body up to
MAX_ROWS rows and a tensor-core body up to MAX_DOT_ROWS): `decode_gemv_quant`; `quant_converts(mode)` whether a server lays its quantised Linear weights out
for it (surojax.quant.gemv_quant; pallas, and auto once QUANT_AUTO is measured: until then auto keeps the fused
GEMM's decode form, pallas_kernels.quant_matmul), `quant_choose(m, mode)` which path a call takes.

Tiles: `tiles_for(n_out, k, m)` -- below DOT_FROM_M rows TUNED_TILES[(n_out, k)] where the benchmark found better
ones, else the default: bn such that the grid has about MIN_PROGRAMS programs (two per SM of an H100 / H200: the
weight is read by every SM), bk so that a weight tile holds TILE_VALUES values (registers: bn x bk / (32
num_warps) fp32 per thread for the tile and its products). From DOT_FROM_M rows TUNED_DOT_TILES[(n_out, k,
M_pad)], else the dot default: bn = M_pad (each program re-reads x [M, K] from L2: x traffic M_pad / bn times the
weight's), halved down to 16 while the grid has fewer than MIN_PROGRAMS / 2 programs; bk 128; 8 warps for a 64 x 64
accumulator, else 4; 3 stages (unmeasured: benchmarks/decode_gemv.py sweeps DOT_CANDIDATES).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_gemv.dot_kernel import MIN_DOT_BN, padded_rows
from pallas_kernels.decode_gemv.kernel import MAX_DOT_ROWS, MAX_ROWS, MIN_BN, GemvTiles, fit, gemv, shape_error
from pallas_kernels.decode_gemv.quant_kernel import MIN_QUANT_BN, QuantRows, quant_gemv
from pallas_kernels.decode_gemv.quant_kernel import layout_error as quant_layout_error

MODES = ("auto", "pallas", "xla")
AUTO_MAX_M = 8           # auto takes the kernel (FMA body) for M <= this on a GPU (measured: the docstring)
AUTO_DOT_MAX_M = 64      # auto takes the kernel (dot body) for MAX_ROWS < M <= this on a GPU (measured: the docstring)
DOT_FROM_M = MAX_ROWS + 1  # the default tiles take the dot body from this many rows (<= MAX_ROWS + 1)
MIN_PROGRAMS = 264
TILE_VALUES = 4096
DOT_BK = 128
TUNED_TILES: dict[tuple[int, int], GemvTiles] = {}
TUNED_DOT_TILES: dict[tuple[int, int, int], GemvTiles] = {}  # (N_out, K, M_pad) -> tiles with dot=True
QUANT_AUTO = False       # auto lays quantised weights out for quant_kernel.py once it is measured faster on a GPU
QUANT_BK = 512           # the quantised layout's K block at most (quant_kernel.QuantRows.bk; `quant_bk`)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"decode_gemv mode {mode!r}: expected one of {', '.join(MODES)}")


def converts(mode: str = "auto") -> bool:
    """Whether weights should be laid out for the kernel ([N, K]) at load under `mode`."""
    _check_mode(mode)
    return mode == "pallas" or (mode == "auto" and on_gpu() and (AUTO_MAX_M > 0 or AUTO_DOT_MAX_M > MAX_ROWS))


def choose(m: int, mode: str = "auto") -> str:
    """'pallas' or 'xla' for a call of m rows under `mode`."""
    _check_mode(mode)
    if mode == "pallas":
        return "pallas" if m <= MAX_DOT_ROWS else "xla"
    if mode == "auto" and on_gpu() and (m <= min(AUTO_MAX_M, MAX_ROWS)
                                        or MAX_ROWS < m <= min(AUTO_DOT_MAX_M, MAX_DOT_ROWS)):
        return "pallas"
    return "xla"


def tiles_for(n_out: int, k: int, m: int = 1) -> GemvTiles:
    """The tiles of an [N_out, K] product at m rows (module docstring), fitted to divide both."""
    if m >= min(DOT_FROM_M, MAX_ROWS + 1):
        return dot_tiles_for(n_out, k, m)
    tuned = TUNED_TILES.get((n_out, k))
    if tuned is None:
        bn = MIN_BN
        while bn < 64 and n_out // (2 * bn) >= MIN_PROGRAMS:
            bn *= 2
        tuned = GemvTiles(bn=bn, bk=max(128, min(1024, TILE_VALUES // bn)))
    return fit(tuned, n_out, k)


def dot_tiles_for(n_out: int, k: int, m: int) -> GemvTiles:
    """The dot body's tiles of an [N_out, K] product at m rows (module docstring), fitted to divide both."""
    m_pad = padded_rows(m)
    tuned = TUNED_DOT_TILES.get((n_out, k, m_pad))
    if tuned is None:
        bn = m_pad
        while bn > MIN_DOT_BN and n_out // bn < MIN_PROGRAMS // 2:
            bn //= 2
        warps = 8 if m_pad * bn >= 64 * 64 else 4  # a 64 x 64 fp32 acc (two when gated) in 4 warps: ~220 registers
        tuned = GemvTiles(bn=bn, bk=DOT_BK, num_warps=warps, num_stages=3, dot=True)
    return fit(tuned, n_out, k)


def weight_error(n: int, k: int, gated: bool = False, m: int = 1) -> str | None:
    """Why a weight [N, K] cannot take the kernel at its default tiles for m rows (None: it can)."""
    return shape_error(n, k, gated, tiles_for(n // 2 if gated else n, k, m))


def decode_gemv(x: jax.Array, wt: jax.Array, *, layer: jax.Array | int | None = None,
                norm_weight: jax.Array | None = None, norm_layer: jax.Array | int | None = None,
                norm: str | None = None, eps: float = 1e-6,
                activation: str | None = None, residual: jax.Array | None = None,
                tiles: GemvTiles | None = None, interpret: bool | None = None, out_dtype=None) -> jax.Array:
    """x [..., K] -> [..., N_out] by the kernel (module docstring); out_dtype float32 (a plain GEMV): the fp32
    sums unrounded. Raises ValueError naming what does not fit: more rows than the tiles' body takes, a K that
    differs, a weight the tiles cannot cover, a layer index without a stack."""
    lead, k = x.shape[:-1], x.shape[-1]
    m = 1
    for d in lead:
        m *= d
    if wt.ndim == 3:
        if layer is None:
            raise ValueError(f"decode GEMV: a stacked weight {wt.shape} needs the layer index")
        rows = wt.reshape(-1, wt.shape[-1])
    elif wt.ndim == 2:
        if layer is not None:
            raise ValueError(f"decode GEMV: a layer index given for one weight {wt.shape}")
        rows, layer = wt, 0
    else:
        raise ValueError(f"decode GEMV: weight {wt.shape}, expected [N, K] or [L, N, K]")
    n = wt.shape[-2]
    if wt.shape[-1] != k:
        raise ValueError(f"decode GEMV: x has K={k}, the transposed weight {wt.shape} has {wt.shape[-1]}")
    n_out = n // 2 if activation is not None else n
    tiles = fit(tiles, n_out, k) if tiles is not None else tiles_for(n_out, k, m)
    if residual is not None:
        residual = residual.reshape(m, n_out)
    y = gemv(x.reshape(m, k), rows, jnp.asarray(layer, jnp.int32), norm_weight, residual,
             None if norm_layer is None else jnp.asarray(norm_layer, jnp.int32), n=n, tiles=tiles,
             norm=norm, eps=eps, activation=activation, interpret=(not on_gpu()) if interpret is None else interpret,
             out_dtype=out_dtype)
    return y.reshape(*lead, n_out)


def quant_converts(mode: str = "auto") -> bool:
    """Whether a server should lay its quantised Linear weights out as QuantRows for the quantised decode GEMV
    (quant_kernel.py) under `mode`: pallas (a GPU, or interpret mode for tests), auto once QUANT_AUTO is measured."""
    _check_mode(mode)
    return mode == "pallas" or (mode == "auto" and on_gpu() and QUANT_AUTO)


def quant_choose(m: int, mode: str = "auto") -> str:
    """'pallas' or 'xla' for a call of m rows on a QuantRows weight under `mode` (m <= MAX_DOT_ROWS)."""
    return "pallas" if m <= MAX_DOT_ROWS and quant_converts(mode) else "xla"


def quant_bk(spec, k: int) -> int | None:
    """The K block of a quantised layout of rows of k values: the largest power of 2 <= QUANT_BK that the format's
    blocks and k allow (a [bn, bk/2] code tile per half and step), None when none does."""
    bk = QUANT_BK
    while bk >= 32:
        if quant_layout_error(spec, k, bk) is None:
            return bk
        bk //= 2
    return None


def quant_bn(n_out: int, m: int = 1, gated: bool = False) -> int:
    """Output columns per program. FMA body (m <= MAX_ROWS): about MIN_PROGRAMS programs (the weight read by every
    SM), 64 at most. Tensor-core body: 32 where that leaves MIN_PROGRAMS / 2 programs or the weight is gated, else
    16 (compiled offline for sm_90: a gated weight at bn 16 spills its decoded tiles, bn 32 does not)."""
    if m > MAX_ROWS:
        return 32 if n_out % 32 == 0 and (gated or n_out // 32 >= MIN_PROGRAMS // 2) else MIN_DOT_BN
    bn = MIN_QUANT_BN
    while bn < 64 and n_out // (2 * bn) >= MIN_PROGRAMS and n_out % (2 * bn) == 0:
        bn *= 2
    return bn


def quant_launch(m: int) -> tuple[int, int]:
    """(num_warps, num_stages): the FMA body 4 / 3; the tensor-core body 4 warps up to 16 rows, 8 above, 2 stages
    (spill-free and within shared memory at the Qwen3-0.6B / 8B linears, benchmarks/triton_offline_check.py)."""
    return (4, 3) if m <= MAX_ROWS else (4 if padded_rows(m) <= 16 else 8, 2)


def quant_weight_error(n: int, gated: bool = False) -> str | None:
    """Why rows of a weight [N, ·] cannot take the quantised kernel at every row count (None: they can)."""
    n_out = n // 2 if gated else n
    if (gated and n % 2) or n_out % MIN_DOT_BN:
        return f"quantised decode GEMV: the output width {n_out} is not a multiple of {MIN_DOT_BN}"
    return None


def decode_gemv_quant(x: jax.Array, w: QuantRows, *, n: int, layer: jax.Array | int = 0,
                      norm_weight: jax.Array | None = None, norm_layer: jax.Array | int | None = None,
                      norm: str | None = None, eps: float = 1e-6, activation: str | None = None,
                      residual: jax.Array | None = None, bn: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, interpret: bool | None = None, out_dtype=None) -> jax.Array:
    """x [..., K] -> [..., N_out] by the quantised kernel: w QuantRows of n rows per layer (R = n, or L n read at
    `layer`), the fused forms as decode_gemv's. ValueError naming what does not fit."""
    lead, k = x.shape[:-1], x.shape[-1]
    m = 1
    for d in lead:
        m *= d
    n_out = n // 2 if activation is not None else n
    err = quant_weight_error(n, activation is not None)
    if err:
        raise ValueError(err)
    if residual is not None:
        residual = residual.reshape(m, n_out)
    warps, stages = quant_launch(m)
    y = quant_gemv(x.reshape(m, k), w, jnp.asarray(layer, jnp.int32), norm_weight, residual,
                   None if norm_layer is None else jnp.asarray(norm_layer, jnp.int32), n=n,
                   bn=bn or quant_bn(n_out, m, activation is not None), num_warps=num_warps or warps,
                   num_stages=num_stages or stages, norm=norm, eps=eps, activation=activation,
                   interpret=(not on_gpu()) if interpret is None else interpret, out_dtype=out_dtype)
    return y.reshape(*lead, n_out)


__all__ = ["AUTO_DOT_MAX_M", "AUTO_MAX_M", "DOT_FROM_M", "MAX_DOT_ROWS", "MAX_ROWS", "MODES", "TUNED_DOT_TILES",
           "TUNED_TILES", "GemvTiles", "QUANT_BK", "QuantRows", "choose", "converts", "decode_gemv",
           "decode_gemv_quant", "dot_tiles_for", "on_gpu", "quant_bk", "quant_bn", "quant_launch", "quant_choose", "quant_converts",
           "quant_weight_error", "tiles_for", "weight_error"]
