"""llama.cpp's IQ4_NL and IQ4_XS quantisers (`quantize_iq4_nl` / `quantize_iq4_xs` with no importance matrix,
what ggml_quantize_chunk and llama-quantize run) in vectorised numpy, byte-exact.

Both share `quantize_row_iq4_nl_impl` (ggml-quants.c) with ntry = 7: per block of 32, weights x^2, a first scale
max / 127 (the non-linear code book KVALUES_IQ4NL spans -127 .. 113), the code of each value the nearest
code-book entry (`best_index_int8`), then 15 trial scales (itry - 127) / max keeping the best weighted
least-squares scale. IQ4_NL stores that scale as fp16 and re-picks the codes with it; IQ4_XS quantises the 8
block scales of a 256-value super-block to 6 bits against d = -max_scale / 32 and re-picks the codes with the
6-bit scale. Same float32 operation order as the C code; sums left to right (see quantize_kquants).
"""
from __future__ import annotations

import numpy as np

from surojax.quant.quantize_kquants import (F32, GROUP_MAX_EPS, _f16_bytes, _seqsum, _signed_absmax, nearest_int,
                                             run_blocks)

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
NTRY = 7


# how many code-book entries are <= n, for the integers n = -128 .. 114 (the entries are integers, so for a float
# x this is the count at floor(x): a table lookup instead of a binary search)
_COUNT_LE = np.searchsorted(KVALUES, np.arange(-128, 115, dtype=np.float32), side="right").astype(np.intp)


def best_index(x: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over KVALUES: the nearest entry, the upper one on ties."""
    mu = _COUNT_LE[(np.clip(np.floor(x), -128, 114) + 128).astype(np.intp)]
    mu = np.clip(mu, 1, 15)
    idx = np.where(x - KVALUES[mu - 1] < KVALUES[mu] - x, mu - 1, mu)
    idx = np.where(x <= KVALUES[0], 0, idx)
    return np.where(x >= KVALUES[15], 15, idx).astype(np.uint8)


def _block_scales(x):
    """x [M, 32] -> the least-squares scale of each block (0 for an all-zero block)."""
    mx, amax = _signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    w = x * x

    def trial(inv):
        q = KVALUES[best_index(inv[:, None] * x)]
        wq = w * q
        return _seqsum(wq * x), _seqsum(wq * q)

    d = -mx / KVALUES[0]
    sumqx, sumq2 = trial(F32(1) / d)
    d = np.where(sumq2 > 0, sumqx / sumq2, F32(0))
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = trial(F32(itry + int(KVALUES[0])) / mx)
        upd = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(upd, sumqx / sumq2, d)
        best = np.where(upd, d * sumqx, best)
    return np.where(zero, F32(0), d).astype(np.float32)


def _pack_nibbles(L):
    """codes [nb, 32 * s] -> [nb, 16 * s]: q[16 i + j] = L[32 i + j] | L[32 i + 16 + j] << 4."""
    q = L.reshape(L.shape[0], -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(L.shape[0], -1)


def iq4_nl_blocks(x):
    """x [nb, 32] -> [nb, 18]: d fp16 | qs[16]."""
    d = _block_scales(x)
    inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0))
    return np.concatenate([_f16_bytes(d), _pack_nibbles(best_index(inv[:, None] * x))], axis=1)


def iq4_xs_blocks(x):
    """x [nb, 256] -> [nb, 136]: d fp16 | scales_h u16 | scales_l[4] | qs[128]."""
    nb = x.shape[0]
    xs = x.reshape(nb, 8, 32)
    scales = _block_scales(xs.reshape(nb * 8, 32)).reshape(nb, 8)
    max_scale, _ = _signed_absmax(scales)
    d = -max_scale / F32(32)
    inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0))
    ls = np.clip(nearest_int(inv[:, None] * scales), -32, 31)
    dl = d[:, None] * ls.astype(np.float32)
    idl = np.where(dl != 0, F32(1) / np.where(dl != 0, dl, F32(1)), F32(0))
    L = best_index(idl[..., None] * xs).reshape(nb, 256)
    u = (ls + 32).astype(np.uint16)
    scales_l = ((u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    return np.concatenate([_f16_bytes(d), scales_h.astype("<u2").view(np.uint8).reshape(nb, 2), scales_l,
                           _pack_nibbles(L)], axis=1)


BLOCK_QUANTIZERS = {"iq4_nl": (iq4_nl_blocks, 32, 18), "iq4_xs": (iq4_xs_blocks, 256, 136)}


def quantize_rows(x: np.ndarray, qtype: str) -> np.ndarray:
    """x [R, K] -> uint8 [R, K // block * type_size], the bytes llama.cpp writes."""
    fn, block, type_size = BLOCK_QUANTIZERS[qtype]
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] % block:
        raise ValueError(f"{qtype}: rows must be [R, K] with K a multiple of {block}, got shape {x.shape}")
    r, k = x.shape
    return run_blocks(x.reshape(-1, block), fn, type_size, 2 ** 20 // block).reshape(r, k // block * type_size)
