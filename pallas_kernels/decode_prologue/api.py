"""`decode_prologue(qkv, cos, sin, k_pool, v_pool, layer, slots, ...)`: the fused decode prologue (kernel.py) for an
attention layer's decode call, and the choice between it and XLA's ops (reference.py's math, run op by op).

    qkv [B, (N + 2K) H] (B <= MAX_ROWS rows, the joined QKV GEMV's output), optional per-head q / k RMSNorm weights
    [H] (`norm` = plain | zero_centered, `eps`), cos / sin [B, H] (one position per row, full rope), the paged pools
    k, v [L, S, K, H] in qkv's dtype, layer [] int32, slots [B] int32 (>= S: padding) -> (q [B, N, H] normed and
    rotated, k_pool, v_pool with the rows' k (normed, rotated) and v written in place).

Mode (the caller's; surojax passes SUROJAX_DECODE_PROLOGUE from its kernel settings, this package reads no
environment): auto | pallas | xla.
    pallas  the kernel for every call it takes (`unsupported` says which it does not; interpret mode off a GPU)
    xla     never
    auto    the kernel on a GPU, XLA elsewhere: measured on an H100 (benchmarks/RESULTS.md, session 26) the engine's
            one-user decode took it at +3 to +6% (Qwen3-0.6B bf16, two runs), +6.5% (Q4_K), +9% (Gemma 3 1B); it
            applies to calls of <= MAX_ROWS rows only, so more users are unchanged
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_prologue.kernel import MAX_ROWS, NORMS, PrologueKnobs, prologue

MODES = ("auto", "pallas", "xla")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def choose(mode: str = "auto") -> str:
    """'pallas' or 'xla' under `mode` (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"decode_prologue mode {mode!r}: expected one of {', '.join(MODES)}")
    return "pallas" if mode == "pallas" or (mode == "auto" and on_gpu()) else "xla"


def unsupported(rows: int, width: int, num_heads: int, pool_shape: tuple[int, ...], dtype, pool_dtype,
                rope_dim: int) -> str | None:
    """Why a call cannot take the kernel (None: it can): more than MAX_ROWS rows, a qkv width that is not
    (N + 2K) H, a pool in another dtype (an FP8 pool), partial rope, or a head dim whose half is no power of 2."""
    if len(pool_shape) != 4:
        return f"decode prologue: pool {pool_shape}, expected [L, S, K, H]"
    _, _, K, H = pool_shape
    half = H // 2
    if not 1 <= rows <= MAX_ROWS:
        return f"decode prologue: {rows} rows, the kernel takes 1..{MAX_ROWS}"
    if width != (num_heads + 2 * K) * H:
        return f"decode prologue: qkv width {width}, expected ({num_heads} + 2 x {K}) x {H}"
    if jnp.dtype(pool_dtype) != jnp.dtype(dtype):
        return f"decode prologue: a {jnp.dtype(pool_dtype).name} pool for {jnp.dtype(dtype).name} keys (FP8: xla)"
    if rope_dim != H:
        return f"decode prologue: rope over {rope_dim} of {H} dims (partial rope: xla)"
    if H % 2 or half & (half - 1):
        return f"decode prologue: head dim {H}, its half must be a power of 2 (a Triton block)"
    return None


def decode_prologue(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                    layer: jax.Array | int, slots: jax.Array, *, num_heads: int,
                    q_norm_weight: jax.Array | None = None, k_norm_weight: jax.Array | None = None,
                    norm_layer: jax.Array | int | None = None, norm: str | None = None, eps: float = 1e-6,
                    knobs: PrologueKnobs | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's call (module docstring). The norm weights are [H], or stacks [L', H] read at row `norm_layer`
    (in place: a layer stack's StackedVector). Raises ValueError naming what does not fit (`unsupported`), a norm
    kind not in NORMS, or norm weights given without both / with the wrong shape."""
    B, width = qkv.shape
    H = k_pool.shape[-1]
    err = unsupported(B, width, num_heads, k_pool.shape, qkv.dtype, k_pool.dtype, cos.shape[-1])
    if err:
        raise ValueError(err)
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"decode prologue: v pool {v_pool.shape} {v_pool.dtype} against k pool {k_pool.shape} "
                         f"{k_pool.dtype}")
    if cos.shape != (B, H) or sin.shape != (B, H):
        raise ValueError(f"decode prologue: cos / sin {cos.shape} / {sin.shape}, expected {(B, H)}")
    if slots.shape != (B,):
        raise ValueError(f"decode prologue: slots {slots.shape}, expected ({B},)")
    if (q_norm_weight is None) != (k_norm_weight is None) or (norm is None) != (q_norm_weight is None):
        raise ValueError("decode prologue: q_norm_weight, k_norm_weight and norm come together (or none of them)")
    if norm is not None:
        if norm not in NORMS:
            raise ValueError(f"decode prologue: norm {norm!r}, expected one of {NORMS}")
        want = (H,) if norm_layer is None else (q_norm_weight.shape[0], H)
        if q_norm_weight.shape != want or k_norm_weight.shape != want:
            raise ValueError(f"decode prologue: norm weights {q_norm_weight.shape} / {k_norm_weight.shape}, "
                             f"expected {want}" + ("" if norm_layer is None else " (stacks read at norm_layer)"))
    elif norm_layer is not None:
        raise ValueError("decode prologue: norm_layer without norm weights")
    return prologue(qkv, cos, sin, k_pool, v_pool, jnp.asarray(layer, jnp.int32), slots, q_norm_weight,
                    k_norm_weight, None if norm_layer is None else jnp.asarray(norm_layer, jnp.int32),
                    num_heads=num_heads, num_kv_heads=k_pool.shape[2], norm=norm, eps=float(eps),
                    knobs=knobs or PrologueKnobs(), interpret=(not on_gpu()) if interpret is None else interpret)


__all__ = ["MAX_ROWS", "MODES", "NORMS", "PrologueKnobs", "choose", "decode_prologue", "on_gpu", "unsupported"]
