"""The op-error bound of an FP8 GEMM, from the formats' rounding (docs/precision.md, "Error bounds").

A value t scaled into a format's normal range is rounded to nearest with a relative error of at most half an ulp:

    E4M3 (3 mantissa bits)  |t^ - t| <= 2^-4 |t|        E5M2 (2 mantissa bits)  |t^ - t| <= 2^-3 |t|

Below the normal range (|t / d| < 2^-6 for E4M3, 2^-14 for E5M2) the spacing is fixed, so the error is at most half
the subnormal step times the factor d: 2^-10 d (E4M3), 2^-17 d (E5M2). With d < 2 amax / fp8_max (per tensor and
per block d is a power of two, at most 2x amax / fp8_max), each operand element obeys
e(t) <= eps |t| + sub * 2 amax_group / fp8_max,  amax_group the amax of its scaling group.

For one output of a GEMM, y = sum_k a_k b_k and y^ = sum_k a^_k b^_k:

    |y^ - y| <= sum_k ( e(a_k) |b_k| + |a_k| e(b_k) + e(a_k) e(b_k) )  +  out * sum_k |a^_k| |b^_k|

The last term is the GEMM's own rounding: its bf16 result (2^-9; the multiply by the power-of-two scales d_a d_b is
exact) and the accumulation order (XLA CPU's bf16-output dot does not keep one fp32 accumulator).
Without subnormals and that term, a forward GEMM (E4M3 x E4M3) is within (1 + 2^-4)^2 - 1 = 12.9 % of
sum |a| |b|, dgrad / wgrad (E5M2 x E4M3) within (1 + 2^-3)(1 + 2^-4) - 1 = 19.5 %. Random signs make the actual
error ~ sqrt(K) times smaller; the bound is what holds for every input. Delayed scaling obeys it only while the
tensor's amax stays within its history's (a larger one saturates at fp8_max: the clipped part is not bounded).
"""
from __future__ import annotations

import numpy as np

HALF_ULP = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
HALF_SUBNORMAL_STEP = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
GEMM_ROUNDING = 2.0 ** -6  # `out` above: 2^-9 plus accumulation order, with room


def element_error(t: np.ndarray, fmt: str, group_amax: np.ndarray) -> np.ndarray:
    """Upper bound on |t^ - t| per element; group_amax: the amax of each element's scaling group (broadcast)."""
    t = np.abs(np.asarray(t, np.float64))
    return HALF_ULP[fmt] * t + HALF_SUBNORMAL_STEP[fmt] * 2.0 * np.asarray(group_amax, np.float64) / FP8_MAX[fmt]


def gemm_error_bound(a: np.ndarray, b: np.ndarray, err_a: np.ndarray, err_b: np.ndarray) -> np.ndarray:
    """Bound on |a^ @ b^ - a @ b| per output for a [M, K], b [K, N] with per-element operand errors err_a, err_b."""
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    quant = err_a @ b + a @ err_b + err_a @ err_b
    return quant + GEMM_ROUNDING * ((a + err_a) @ (b + err_b))


def worst_relative(fmt_a: str, fmt_b: str) -> float:
    """(1 + eps_a)(1 + eps_b) - 1: the normal-range part of the bound relative to sum |a| |b|."""
    return (1 + HALF_ULP[fmt_a]) * (1 + HALF_ULP[fmt_b]) - 1


__all__ = ["HALF_ULP", "HALF_SUBNORMAL_STEP", "FP8_MAX", "GEMM_ROUNDING", "element_error", "gemm_error_bound",
           "worst_relative"]
