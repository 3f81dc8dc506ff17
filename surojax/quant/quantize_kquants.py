"""llama.cpp's reference K-quant quantisers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in vectorised numpy, byte-exact.

These follow ggml's `quantize_row_q{2..6}_K_ref` (ggml/src/ggml-quants.c), which is what `llama-quantize` runs
when no importance matrix is given: the same search grids (`make_qkx2_quants` for the asymmetric types Q2_K /
Q4_K / Q5_K, `make_q3_quants` for Q3_K, `make_qx_quants` with rmse_type 1 for Q6_K), the same float32
arithmetic in the same order, the same rounding (`nearest_int`, the 1.5 * 2^23 trick, emulated bit for bit) and
fp16 conversion (round to nearest even). Byte equality with llama.cpp's own quantiser is tested on random rows
(tests/quant/test_quantize_kquants.py, golden bytes made by scripts/make_gguf_fixtures.py).

How it is vectorised: every (sub-)block is independent, so each step of the C loops runs on all blocks at once
(the searches hold the blocks as columns of a [n, M] array). The only order-sensitive parts are the float32
sums over a block's n values: C adds them one after the other (ggml-quants.c is built without -ffast-math or
FMA contraction), and `_colsum` / `_seqsum` do the same, one vector add per value. The data-dependent loops
(make_q3_quants' coordinate descent, the "keep the better candidate" updates) become masked `np.where` updates;
make_q3_quants' early `break` when a pass changes nothing is dropped, which cannot change the result (a pass
that changes nothing leaves the state as it was, so the next one changes nothing either).

Entry point: `quantize_rows(x [R, K] float32, "q4_k") -> uint8 [R, K // 256 * type_size]` (the GGUF row bytes).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32
_CHUNK = 4096  # super-blocks per numpy pass (bounds the temporaries to a few tens of MiB)


# -- ggml helpers ---------------------------------------------------------------------------------------------
def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2^23 in float32 and read the low mantissa bits (round half to even for
    |v| < 2^22; the same garbage as C outside that range, which the callers then clamp)."""
    t = (np.asarray(v, np.float32) + F32(12582912.0)).view(np.int32)
    return (t & 0x007FFFFF) - 0x00400000


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis of a [M, n] array in float32, left to right (as a C `for` loop does). Column by
    column on the transposed copy: much faster than np.add.accumulate along a short last axis."""
    t = np.ascontiguousarray(np.asarray(a, np.float32).T)
    acc = t[0].copy()
    for i in range(1, t.shape[0]):
        acc += t[i]
    return acc


def _f16(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 (round to nearest even) -> float16."""
    return np.asarray(v, np.float32).astype(np.float16)


def _u8(v: np.ndarray) -> np.ndarray:
    """C's store of an int into uint8_t (modulo 256)."""
    return (np.asarray(v, np.int64) & 0xFF).astype(np.uint8)


def _i8(v: np.ndarray) -> np.ndarray:
    """C's store of an int into int8_t (two's complement wrap)."""
    return (((np.asarray(v, np.int64) + 128) & 0xFF) - 128).astype(np.int8)


def _signed_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (the value of largest magnitude, first one on ties; its magnitude); 0 for an all-zero row."""
    ax = np.abs(x)
    idx = np.argmax(ax, axis=-1)
    amax = np.take_along_axis(ax, idx[..., None], -1)[..., 0]
    return np.take_along_axis(x, idx[..., None], -1)[..., 0], amax


# -- the block searches ---------------------------------------------------------------------------------------
# They take blocks as rows, x [M, n], and work on the transposed copy [n, M] (value i of every block is one
# contiguous row), so that per-block vectors [M] broadcast over it and the sequential sums are n vector adds.
def _colsum(t: np.ndarray) -> np.ndarray:
    """[n, M] -> [M]: t[0] + t[1] + ... left to right in float32."""
    acc = t[0].copy()
    for i in range(1, t.shape[0]):
        acc += t[i]
    return acc


def make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Asymmetric search: x ~ scale * L - the_min, L in [0, nmax]. x, w: [M, n] float32.
    Returns (L uint8 [M, n], scale [M], the_min [M])."""
    x, w = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)  # [n, M]
    nmax_f = F32(nmax)
    mn = np.minimum(x.min(axis=0), F32(0))
    mx = x.max(axis=0)
    sum_w = _colsum(w)
    sum_x = _colsum(w * x)  # C starts from sum_w * x[0] = w[0] * x[0]: the same sum
    flat = mx == mn
    mn0 = mn

    def err(scale, L, mins):
        diff = scale * L + mins - x
        diff = np.abs(diff) if use_mad else diff * diff
        return _colsum(w * diff)

    iscale = nmax_f / np.where(flat, F32(1), mx - mn)
    scale = F32(1) / iscale
    L = np.clip(nearest_int(iscale * (x - mn)), 0, nmax).astype(np.float32)
    best = err(scale, L, mn)
    for step in range(nstep + 1):  # an accepted candidate moves `min`, which the next steps start from
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + nmax_f) / np.where(flat, F32(1), mx - mn)
        la = np.clip(nearest_int(iscale * (x - mn)), 0, nmax).astype(np.float32)
        wl = w * la
        sum_l, sum_l2, sum_xl = _colsum(wl), _colsum(wl * la), _colsum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, F32(0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        cur = err(this_scale, la, this_min)
        upd = (D > 0) & (cur < best)
        L = np.where(upd, la, L)
        best = np.where(upd, cur, best)
        scale = np.where(upd, this_scale, scale)
        mn = np.where(upd, this_min, mn)
    L = np.where(flat, F32(0), L)
    scale = np.where(flat, F32(0), scale)
    mn = np.where(flat, mn0, mn)
    return L.T.astype(np.uint8), scale.astype(np.float32), (-mn).astype(np.float32)


def _signed_absmax_t(x):
    """[n, M] -> per column (the value of largest magnitude, first on ties; its magnitude)."""
    ax = np.abs(x)
    idx = np.argmax(ax, axis=0)[None]
    return np.take_along_axis(x, idx, 0)[0], np.take_along_axis(ax, idx, 0)[0]


def make_qx_quants_rmse1(x, nmax: int):
    """Symmetric search with weights x^2 (make_qx_quants, rmse_type 1, no importance): x ~ scale * (L - nmax).
    Returns (L uint8 [M, n] in [0, 2 nmax), scale [M])."""
    x = np.ascontiguousarray(x.T)  # [n, M]
    mx, amax = _signed_absmax_t(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    w = x * x
    wx = w * x

    def trial(iscale):
        lq = np.clip(nearest_int(iscale * x), -nmax, nmax - 1).astype(np.float32)
        return lq, _colsum(wx * lq), _colsum(w * lq * lq)

    lq, sumlx, suml2 = trial(F32(-nmax) / mx)
    L = lq
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        lq, sumlx, suml2 = trial(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
        upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(upd, lq, L)
        scale = np.where(upd, sumlx / suml2, scale)
        best = np.where(upd, scale * sumlx, best)
    L = np.where(zero, F32(-nmax), L)
    scale = np.where(zero, F32(0), scale)
    return (L + nmax).T.astype(np.uint8), scale.astype(np.float32)


def make_q3_quants(x, nmax: int = 4):
    """Q3_K's symmetric search with coordinate descent (make_q3_quants, do_rmse). Returns (L uint8 [M, n] in
    [0, 2 nmax), scale [M])."""
    x = np.ascontiguousarray(x.T)  # [n, M]
    mx, amax = _signed_absmax_t(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    L = np.clip(nearest_int((F32(-nmax) / mx) * x), -nmax, nmax - 1).astype(np.float32)
    w = x * x
    sumlx = _colsum(w * x * L)
    suml2 = _colsum(w * L * L)
    for _ in range(5):
        for i in range(x.shape[0]):
            wi, xi, li = w[i], x[i], L[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new_l = np.clip(nearest_int(xi * sl2 / slx), -nmax, nmax - 1).astype(np.float32)
            slx2 = slx + wi * xi * new_l
            sl22 = sl2 + wi * new_l * new_l
            upd = (slx > 0) & (new_l != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[i] = np.where(upd, new_l, li)
            sumlx = np.where(upd, slx2, sumlx)
            suml2 = np.where(upd, sl22, suml2)
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L = np.where(zero, F32(-nmax), L)
    scale = np.where(zero, F32(0), scale)
    return (L + nmax).T.astype(np.uint8), scale.astype(np.float32)


# -- packing helpers ------------------------------------------------------------------------------------------
def _pack_2bit(L):
    """L [nb, 256] in 0..3 -> qs [nb, 64]: qs[32 h + l] = L[128h+l] | L[128h+l+32] << 2 | ... << 6."""
    q = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_scale_min_k4(ls, lm):
    """6-bit scales and mins [nb, 8] -> the 12 packed bytes of Q4_K / Q5_K (inverse of get_scale_min_k4)."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4]
    out[:, 4:8] = lm[:, :4]
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def _f16_bytes(v):
    return _f16(v).view(np.uint8).reshape(-1, 2)


def _refine(L, x, d, dm, lo: int, hi: int):
    """The final requantisation with the stored (fp16) scales: L = clamp(nearest_int((x + dm) / d)), kept where
    d == 0 (`if (!d) continue`). x [nb, S, n], d / dm [nb, S]."""
    q = np.clip(nearest_int((x + dm[..., None]) / d[..., None]), lo, hi)
    return np.where((d != 0)[..., None], q, L.reshape(x.shape)).reshape(L.shape)


# -- the five types: blocks x [nb, 256] float32 -> bytes [nb, type_size] --------------------------------------
def _q_kx(x, sub: int, nmax: int, rmin: float, nstep: int):
    """The shared front of Q4_K / Q5_K: 8 sub-blocks of 32, weights av_x + |x|; -> (L, ls, lm, d, dmin)."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, sub)
    av_x = np.sqrt(_seqsum(xs * xs) / F32(32))
    wts = av_x[:, None] + np.abs(xs)
    L, scales, mins = make_qkx2_quants(xs, wts, nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, F32(1)), F32(0))
    inv_min = np.where(max_min > 0, F32(63) / np.where(max_min > 0, max_min, F32(1)), F32(0))
    ls = np.minimum(_u8(nearest_int(inv_scale[:, None] * scales)), 63)
    lm = np.minimum(_u8(nearest_int(inv_min[:, None] * mins)), 63)
    d, dmin = _f16(max_scale / F32(63)), _f16(max_min / F32(63))
    dd = d.astype(np.float32)[:, None] * ls.astype(np.float32)
    dm = dmin.astype(np.float32)[:, None] * lm.astype(np.float32)
    L = _refine(L.reshape(nb, 256), x.reshape(nb, 8, 32), dd, dm, 0, nmax)
    return L.astype(np.uint8), ls, lm, d, dmin


def q4_k_blocks(x):
    L, ls, lm, d, dmin = _q_kx(x, 32, 15, -1.0, 20)
    q = L.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min_k4(ls, lm), qs], axis=1)


def q5_k_blocks(x):
    L, ls, lm, d, dmin = _q_kx(x, 32, 31, -0.5, 15)
    q = L.reshape(-1, 4, 2, 32)                                   # [nb, 64-chunk n, half, j]
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    qh = (((q[:, :, 0] >> 4) << shifts) | ((q[:, :, 1] >> 4) << (shifts + 1))).sum(axis=1, dtype=np.uint8)
    ql = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min_k4(ls, lm), qh, ql], axis=1)


def q2_k_blocks(x):
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    L, scales, mins = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    has_s, has_m = max_scale > 0, max_min > 0
    iscale = F32(15) / np.where(has_s, max_scale, F32(1))
    imin = F32(15) / np.where(has_m, max_min, F32(1))
    sc = np.where(has_s[:, None], _u8(nearest_int(iscale[:, None] * scales)), 0).astype(np.uint8)
    sc = sc | np.where(has_m[:, None], _u8(nearest_int(imin[:, None] * mins) << 4), 0).astype(np.uint8)
    d = np.where(has_s, _f16(max_scale / F32(15)), np.float16(0))
    dmin = np.where(has_m, _f16(max_min / F32(15)), np.float16(0))
    dd = d.astype(np.float32)[:, None] * (sc & 0xF).astype(np.float32)
    dm = dmin.astype(np.float32)[:, None] * (sc >> 4).astype(np.float32)
    L = _refine(L.reshape(nb, 256), x.reshape(nb, 16, 16), dd, dm, 0, 3)
    return np.concatenate([sc, _pack_2bit(L), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def q3_k_blocks(x):
    nb = x.shape[0]
    L, scales = make_q3_quants(x.reshape(nb * 16, 16), 4)
    scales = scales.reshape(nb, 16)
    max_scale, _ = _signed_absmax(scales)
    has = max_scale != 0
    iscale = F32(-32) / np.where(has, max_scale, F32(1))
    ls = (np.clip(_i8(nearest_int(iscale[:, None] * scales)).astype(np.int32), -32, 31) + 32).astype(np.uint8)
    ls = np.where(has[:, None], ls, 0).astype(np.uint8)
    packed = np.zeros((nb, 12), np.uint8)
    packed[:, 0:8] = (ls[:, 0:8] & 0xF) | ((ls[:, 8:16] & 0xF) << 4)
    hi = (ls >> 4).reshape(nb, 4, 4)                              # [nb, j // 4, j % 4]
    packed[:, 8:12] = (hi << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(axis=1, dtype=np.uint8)
    d = np.where(has, _f16(F32(1) / iscale), np.float16(0))
    sc = ls.astype(np.float32) - F32(32)                        # decoded scale (-32 where all were zero)
    dd = d.astype(np.float32)[:, None] * sc
    L = L.reshape(nb, 256).astype(np.int32)
    q = np.clip(nearest_int(x.reshape(nb, 16, 16) / dd[..., None]), -4, 3) + 4
    L = np.where((dd != 0)[..., None], q, L.reshape(nb, 16, 16)).reshape(nb, 256)
    hbits = (L > 3).reshape(nb, 8, 32).astype(np.uint8)           # value 32*b + m -> bit b of hmask[m]
    hmask = (hbits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([hmask, _pack_2bit(L & 3), packed, _f16_bytes(d)], axis=1)


def q6_k_blocks(x):
    nb = x.shape[0]
    L, scales = make_qx_quants_rmse1(x.reshape(nb * 16, 16), 32)
    scales = scales.reshape(nb, 16)
    max_scale, max_abs = _signed_absmax(scales)
    zero = max_abs < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(zero, F32(1), max_scale)
    d = np.where(zero, np.float16(0), _f16(F32(1) / iscale))
    sc = _i8(np.minimum(127, nearest_int(iscale[:, None] * scales)))
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    dd = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    L = L.reshape(nb, 256).astype(np.int32)
    q = np.clip(nearest_int(x.reshape(nb, 16, 16) / dd[..., None]), -32, 31) + 32
    L = np.where((dd != 0)[..., None], q, L.reshape(nb, 16, 16)).reshape(nb, 2, 4, 32)  # [nb, half, quarter, l]
    L = np.where(zero[:, None, None, None], 0, L).astype(np.uint8)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


BLOCK_QUANTIZERS = {"q2_k": (q2_k_blocks, 84), "q3_k": (q3_k_blocks, 110), "q4_k": (q4_k_blocks, 144),
                    "q5_k": (q5_k_blocks, 176), "q6_k": (q6_k_blocks, 210)}


def quantize_rows(x: np.ndarray, qtype: str) -> np.ndarray:
    """x [R, K] (K a multiple of 256) -> uint8 [R, K // 256 * type_size], the bytes llama.cpp writes."""
    fn, type_size = BLOCK_QUANTIZERS[qtype]
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"{qtype}: rows must be [R, K] with K a multiple of {QK_K}, got shape {x.shape}")
    r, k = x.shape
    return run_blocks(x.reshape(-1, QK_K), fn, type_size, _CHUNK).reshape(r, k // QK_K * type_size)


def run_blocks(blocks: np.ndarray, fn, type_size: int, chunk: int) -> np.ndarray:
    """fn over `chunk` blocks at a time (bounded temporaries, cache-friendly) -> uint8 [n_blocks, type_size].
    numpy releases the GIL inside its array operations, so chunks run in parallel threads."""
    out = np.empty((blocks.shape[0], type_size), np.uint8)

    def run(s):
        with np.errstate(all="ignore"):
            out[s:s + chunk] = fn(blocks[s:s + chunk])

    starts = range(0, blocks.shape[0], chunk)
    workers = min(len(starts), os.cpu_count() or 1, 16)
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, starts))
    else:
        for s in starts:
            run(s)
    return out
