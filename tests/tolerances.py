"""Tolerances derived from the computation, not tuned on one machine.

Two float computations of the same sums in different orders (another GEMM blocking, a joined kernel, another CPU's
vector width) differ by rounding alone. Each rounding of a length-K sum adds an error of at most u = eps / 2 times
the running sum; modelled as independent, zero-mean errors (Higham & Mary, "A new approach to probabilistic
rounding error analysis", SIAM J. Sci. Comput. 2019), the error of the sum has a standard deviation of about
sqrt(K) * u * sum|terms|, and the difference of two orders sqrt(2K) * u * sum|terms|. `reorder_atol` bounds that
difference at `sigmas` standard deviations, with `scale` the magnitude the sums are compared at (e.g. the largest
|value| of the reference result). The worst case (K * u, every rounding in the same direction) is not the bound:
it is ~sqrt(K) times looser and lets real defects through; a layout or indexing mistake moves values by O(scale).
"""
from __future__ import annotations

import math

import numpy as np


def reorder_atol(k: int, dtype, scale: float, sigmas: float = 6.0) -> float:
    """Absolute tolerance between two results of length-`k` sums in `dtype` that differ only in summation order."""
    u = float(np.finfo(np.dtype(dtype)).eps) / 2
    return sigmas * math.sqrt(2 * k) * u * float(scale)
