"""FP8 matmuls with per-tensor scaling, written so that XLA GPU runs them as scaled FP8 cuBLASLt GEMMs.

    fp8_dot(x, w)                 x [..., K] (bf16), w [K, N] (a trainable weight): both quantised to E4M3 this
                                  step; backward: dy quantised to E5M2, dx = dy @ w^T and dw = x^T @ dy as FP8 GEMMs
    fp8_dot_cached(x, w, w_q, w_qt, w_d)
                                  fp8_dot with w's E4M3 copies made once per step (quantize_weight: the same bits),
                                  not at each use (forward and recompute); w receives the weight gradient
    fp8_dot_frozen(x, w_q, w_d)   the same with a weight quantised once (a frozen LoRA base): w_q [K, N] E4M3 and
                                  its dequantisation factor w_d; no weight gradient

Every GEMM is written `dot_general(a_q, b_q)` on the FP8 arrays themselves (fp32 accumulation, bf16 result), then
multiplied by a_d * b_d (the "direct" form, as flax's fp8_ops writes it): XLA's GEMM rewriter (Ada / Hopper
and newer, CUDA >= 12) turns a dot whose operands *are* FP8 into one `__cublas$lt$matmul$f8` custom call (or the
Triton GEMM emitter runs it on FP8 tensor cores); elsewhere (CPU) the same dot runs on the upcast values, so the CPU
tests check the numbers the GPU computes up to accumulation order. `benchmarks/fp8_gemm_check.py` reads the compiled
HLO to see which one happened and holds the result to the fp32 product of the dequantised operands.

Why not `dot(convert(a_q) * a_d, convert(b_q) * b_d)` ("qdq", still selectable with SUROJAX_FP8_DOT=qdq, one of
the kernel settings read once per process: surojax/kernel_settings.py)? XLA
GPU may compile it as plain bf16 cuBLAS GEMMs *without* the FP8 rounding of the activations, and did on the GPU
checked (its error off the fp32 product of the FP8 operands matched that of leaving out the E4M3 rounding of x:
benchmarks/RESULTS.md, fp8_gemm_check). The quantiser of x is `convert(f32 -> f8)` read only by `convert(f8 -> bf16)`, a chain that
XLA GPU's SimplifyFPConversions (on by default, xla_allow_excess_precision) rewrites as one `f32 -> bf16` convert;
with x no longer FP8 the GEMM cannot be an FP8 GEMM. Which pass order exposes the chain (Triton GemmFusion takes
such dots before the FP8 rewriter; the autotuner's cuBLAS fallback meets them after the float normalisation) is
read from XLA's sources, not measured: fp8_gemm_check's `qdq+noexcess` / `qdq+notriton` variants test it. In the
direct form no FP8 value is converted back to a wider type, so there is no chain to collapse, and a dot on two FP8
operands (no fusible producer: a "pure" matmul that GemmFusion leaves alone) is what the rewriter turns into
cuBLASLt directly. See docs/precision.md.

The quantisers are straight-through (the gradient of round + saturate is taken as the identity, as Transformer
Engine does). Scaling here is *current* (each tensor's own amax, this step; `fp8_scaling: current`); delayed scaling
is fp8_delayed.py, block-wise fp8_blockwise.py. The price of current scaling is one extra read of each quantised
tensor for its amax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from surojax.kernel_settings import Fp8Accum, Fp8Dot, Fp8Wgrad, kernel_settings
from surojax.precision.fp8_scaling import (E4M3, E5M2, current_factor, dequantize, quantize_both,
                                           quantize_current)

MARGIN = 0  # 2^-margin headroom in the scale (Transformer Engine's default)


def dot_form() -> Fp8Dot:
    """How the scaled GEMM is written for XLA (`kernel_settings().fp8_dot`, SUROJAX_FP8_DOT): `direct` (default)
    dot_general on the FP8 arrays (bf16 result) times a_d * b_d; `qdq` dot(convert(a_q) * a_d, convert(b_q) * b_d)
    in bf16, the textbook pattern of XLA's FP8 rewriter, which XLA may leave unfolded (module docstring;
    benchmarks/RESULTS.md).
    benchmarks/fp8_gemm_check.py compiles and times both."""
    return kernel_settings().fp8_dot


# The error of one scaled GEMM against the fp32 product of its dequantised operands, relative to that product's
# largest entry. Direct form: the GEMM's bf16 result is rounded once (2^-9; the scales are powers of two, so
# a_d * b_d and y * scale are exact, folded into cuBLASLt's scale or not), plus accumulation order (XLA CPU's
# bf16-output dot does not keep one fp32 accumulator: ~4e-3 alone); 6e-3 holds both. A quantiser that XLA optimised
# away is several times over it (2.7 % for x on the 0.6B-sized GEMM), an operand on another E4M3 grid ~1.5 %.
DIRECT_REL_ERR = 6e-3
# qdq form: the operands q * d are rounded to bf16 before the GEMM, an error per product term that does not shrink
# with the sum, so only a loose bound holds (1 %); folded into cuBLASLt (scales applied in fp32) it is one rounding.
QDQ_REL_ERR = 1e-2


ACCUMULATIONS = tuple(m.value for m in Fp8Accum)


def accumulation() -> Fp8Accum:
    """How the FP8 GEMMs accumulate on the GPU (`kernel_settings().fp8_accum`, SUROJAX_FP8_ACCUM). XLA gives an FP8
    dot of DEFAULT precision cuBLASLt's fast accumulation (Hopper's tensor cores keep the partial sums in a
    narrower accumulator, promoted to fp32 less often) and one of precision HIGHEST the fp32 ("split") one.
    `split` (default, Transformer Engine's choice): the forward GEMMs accumulate fast, the gradient GEMMs (dx, dW,
        E5M2 dy) in fp32;
    `fp32`: every GEMM in fp32 (the forward GEMM slower, its op error unchanged: benchmarks/RESULTS.md,
        session 13);
    `fast`: every GEMM fast (before session 13).
    On CPU the precision changes nothing."""
    return kernel_settings().fp8_accum


def _scaled_dot(a_q, a_d, b_q, b_d, dims, dtype, *, forward: bool = False):
    """dot_general(a_q * a_d, b_q * b_d) in `dtype` (fp32 accumulation inside the GEMM, fast or not: `forward`
    says which GEMM this is, `accumulation()` what it gets)."""
    if dot_form() is Fp8Dot.DIRECT:
        mode = accumulation()
        fast = mode is Fp8Accum.FAST or (forward and mode is Fp8Accum.SPLIT)
        y = jax.lax.dot_general(a_q, b_q, (dims, ((), ())), preferred_element_type=dtype,
                                precision=None if fast else jax.lax.Precision.HIGHEST)
        # multiply(gemm, broadcast(scalar)) right on the GEMM's result: XLA folds it into the FP8 GEMM's scale
        return y * (a_d.astype(jnp.float32) * b_d.astype(jnp.float32)).astype(dtype)
    return jax.lax.dot_general(dequantize(a_q, a_d, dtype), dequantize(b_q, b_d, dtype), (dims, ((), ())),
                               preferred_element_type=dtype)


_NN = ((1,), (0,))  # [M, K] @ [K, N]
_NT = ((1,), (1,))  # dy [M, N] @ w [K, N]^T -> [M, K]


def _flat(x):
    return x.reshape(-1, x.shape[-1])  # [..., K] -> [M, K]


def _backward_dx(g2, w_q, w_d, dtype):
    g_q, g_d = quantize_current(g2, E5M2, dtype, MARGIN)
    return _scaled_dot(g_q, g_d, w_q, w_d, _NT, dtype), (g_q, g_d)


# ---- trainable weight: both operands quantised every step -----------------------------------------------------
# Hopper's FP8 GEMMs take both operands K-major, so each tensor is quantised into both layouts at once
# (`quantize_both`: one pass on a GPU): x [M, K] for the forward and x^T [K, M] for dW, W^T [N, K] for the forward
# and W [K, N] for dx, dy [M, N] for dx and dy^T [N, M] for dW. Every GEMM below then contracts the minor
# dimension of both operands (_NT) and XLA has nothing left to transpose.

def _current_both(t, dtype, compute_dtype):
    """Current scaling: (q, q^T, d) from t's own amax."""
    d = current_factor(t, dtype, compute_dtype, MARGIN)
    q, qt, _ = quantize_both(t, d, dtype)
    return q, qt, d


@jax.custom_vjp
def fp8_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, both operands E4M3 (current per-tensor scaling)."""
    return _fp8_dot_fwd(x, w)[0]


def _fp8_dot_fwd(x, w):
    dtype = x.dtype
    x_q, x_qt, x_d = _current_both(_flat(x), E4M3, dtype)
    w_q, w_qt, w_d = _current_both(w, E4M3, dtype)
    y = _scaled_dot(x_q, x_d, w_qt, w_d, _NT, dtype, forward=True)
    return y.reshape(*x.shape[:-1], w.shape[-1]), (x_qt, x_d, w_q, w_d, jnp.zeros((), w.dtype))


def wgrad_form() -> Fp8Wgrad:
    """`kernel_settings().fp8_wgrad` (SUROJAX_FP8_WGRAD; current scaling's GEMMs): `compute` (default) the
    weight-gradient GEMM writes the compute dtype, then converted to the weight's; `weight` the weight's own dtype
    straight from the GEMM (an fp32 master's gradient then skips the bf16 rounding and the convert pass; for A/B
    runs: whether XLA keeps such a GEMM on cuBLASLt FP8 is measured by benchmarks/fp8_gemm_check.py's census)."""
    return kernel_settings().fp8_wgrad


def wgrad_dtype(compute_dtype, weight_dtype):
    """The dtype the weight-gradient GEMM writes (`wgrad_form`)."""
    return weight_dtype if wgrad_form() is Fp8Wgrad.WEIGHT else compute_dtype


def _fp8_dot_bwd(res, g):
    x_qt, x_d, w_q, w_d, w_dtype = res  # w_dtype: a scalar carrying the weight's dtype (fp32 master or bf16)
    dtype = g.dtype
    g_q, g_qt, g_d = _current_both(_flat(g), E5M2, dtype)
    dx = _scaled_dot(g_q, g_d, w_q, w_d, _NT, dtype)
    dw = _scaled_dot(x_qt, x_d, g_qt, g_d, _NT, wgrad_dtype(dtype, w_dtype.dtype))
    return dx.reshape(*g.shape[:-1], w_q.shape[0]), dw.astype(w_dtype.dtype)


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


# ---- trainable weight quantised once per step ------------------------------------------------------------------

def quantize_weight(w: jax.Array, compute_dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(w_q [K, N], w_qt [N, K], w_d): what `fp8_dot` makes of w at every use, for `fp8_dot_cached` (current
    scaling: the same bits)."""
    return _current_both(w, E4M3, compute_dtype)


@jax.custom_vjp
def fp8_dot_cached(x: jax.Array, w: jax.Array, w_q: jax.Array, w_qt: jax.Array, w_d: jax.Array) -> jax.Array:
    """`fp8_dot(x, w)` with w's E4M3 copies made once per step (`quantize_weight`, fp8_transform's weight cache):
    the forward and the recompute read w_qt, the input gradient w_q; w itself only receives the weight gradient.
    The same values as fp8_dot; the copies get no gradient (they are the step's constants)."""
    return _cached_fwd(x, w, w_q, w_qt, w_d)[0]


def _cached_fwd(x, w, w_q, w_qt, w_d):
    dtype = x.dtype
    x_q, x_qt, x_d = _current_both(_flat(x), E4M3, dtype)
    y = _scaled_dot(x_q, x_d, w_qt, w_d, _NT, dtype, forward=True)
    return y.reshape(*x.shape[:-1], w_qt.shape[0]), (x_qt, x_d, w_q, w_d, jnp.zeros((), w.dtype))


def _cached_bwd(res, g):
    dx, dw = _fp8_dot_bwd(res, g)
    return dx, dw, None, None, None


fp8_dot_cached.defvjp(_cached_fwd, _cached_bwd)


# ---- frozen weight quantised once ---------------------------------------------------------------------------

@jax.custom_vjp
def fp8_dot_frozen(x: jax.Array, w_q: jax.Array, w_d: jax.Array) -> jax.Array:
    """x [..., K] @ (w_q [K, N] E4M3 * w_d) -> [..., N] in x's dtype; x quantised to E4M3 (current scaling)."""
    return _frozen_fwd(x, w_q, w_d)[0]


def _frozen_fwd(x, w_q, w_d):
    dtype = x.dtype
    x_q, x_d = quantize_current(_flat(x), E4M3, dtype, MARGIN)
    y = _scaled_dot(x_q, x_d, w_q, w_d, _NN, dtype, forward=True)
    return y.reshape(*x.shape[:-1], w_q.shape[-1]), (w_q, w_d)


def _frozen_bwd(res, g):
    w_q, w_d = res
    dx, _ = _backward_dx(_flat(g), w_q, w_d, g.dtype)
    return dx.reshape(*g.shape[:-1], w_q.shape[0]), jnp.zeros_like(w_q), jnp.zeros_like(w_d)


fp8_dot_frozen.defvjp(_frozen_fwd, _frozen_bwd)


def reference_dot(x_q, x_d, w_q, w_d) -> jax.Array:
    """The exact product of the dequantised operands in fp32 (tests)."""
    a = x_q.astype(jnp.float32) * jnp.asarray(x_d, jnp.float32)
    b = w_q.astype(jnp.float32) * jnp.asarray(w_d, jnp.float32)
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


__all__ = ["accumulation", "ACCUMULATIONS", "fp8_dot", "fp8_dot_cached", "quantize_weight", "wgrad_dtype",
           "wgrad_form", "fp8_dot_frozen", "reference_dot", "dot_form", "MARGIN", "DIRECT_REL_ERR", "QDQ_REL_ERR"]
