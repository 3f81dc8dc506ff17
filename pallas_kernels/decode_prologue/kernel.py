"""The decode prologue as one Pallas (Triton) kernel: split of the joined QKV GEMV's output, per-head q / k RMSNorm,
rope on q and k, and the write of the new k / v into the paged pool, for a decode call's few rows (reference.py
holds the math; api.py the checks and the choice).

Grid (B, N + K): program (b, h) takes one head of row b, a vector of H values, read as its two halves (rope's
rotate_half pairs dim i with i + H/2, so the halves are rotated against each other and nothing is sliced in-kernel):

    h <  N   query head h:  load qkv[b, h H ..], norm, rope, store q[b, h]
    h >= N   kv head h - N: load its k and v, norm and rope k; when slot_b < S store k and v at
             pool[layer, slot_b, h - N] (a slot >= S is padding: nothing written)

The pools are aliased to the outputs (input_output_aliases): the kernel writes the B slots in place and no other
slot is read or written; under jit with the pool donated or carried (the decoder's layer loop), XLA passes the
pool's buffer through without a copy (called on its own, eagerly, the pools are copied first unless the caller's jit
donates them).

Roundings (dt = qkv's dtype) follow the decoder's ops: the norm's statistics in fp32; plain: rd(w) * rd(normed)
rounded; zero_centered: normed * (1 + w) in fp32, rounded once; rope: rd(x cos), rd(x' sin) and their sum
rounded, each op as XLA rounds it.

Knobs: num_warps / num_stages (Triton). H / 2 must be a power of 2 (a Triton block).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 8
NORMS = ("plain", "zero_centered")


@dataclasses.dataclass(frozen=True)
class PrologueKnobs:
    """Triton's launch settings of one program (one head of H values: a warp holds it)."""

    num_warps: int = 1
    num_stages: int = 1

    def label(self) -> str:
        return f"w{self.num_warps}-s{self.num_stages}"


def _prologue_kernel(layer_ref, slots_ref, qkv_ref, cos_ref, sin_ref, *refs, n: int, k: int, h: int, s: int,
                     norm: str | None, eps: float):
    refs = list(refs)
    qn_ref = refs.pop(0) if norm else None  # the norm weights flattened [R H], read at row norm_row_ref[0]
    kn_ref = refs.pop(0) if norm else None
    norm_row_ref = refs.pop(0) if norm else None
    _k_in, _v_in, q_ref, k_out, v_out = refs  # the pools' input refs are the outputs' buffers (aliased)
    dt = qkv_ref.dtype
    f32 = jnp.float32
    half = h // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    b, head = pl.program_id(0), pl.program_id(1)
    rd = lambda x: x.astype(dt).astype(f32)  # noqa: E731  one rounding to dt, as each of the decoder's ops

    def load(start):  # the two halves of one head's H values, fp32 holding dt values
        return qkv_ref[b, pl.ds(start, half)].astype(f32), qkv_ref[b, pl.ds(start + half, half)].astype(f32)

    def rms_norm(x1, x2, w_ref):
        if norm is None:
            return x1, x2
        rstd = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / h + eps)
        start = norm_row_ref[0] * h
        w1, w2 = w_ref[pl.ds(start, half)].astype(f32), w_ref[pl.ds(start + half, half)].astype(f32)
        if norm == "plain":  # rd(w) * rd(normed), rounded
            return rd(rd(w1) * rd(x1 * rstd)), rd(rd(w2) * rd(x2 * rstd))
        return rd(x1 * rstd * (1.0 + w1)), rd(x2 * rstd * (1.0 + w2))  # zero-centred: in fp32, rounded once

    def rope(x1, x2):  # [x1, x2] * cos + [-x2, x1] * sin, each product and the sum rounded
        c1, c2 = cos_ref[b, lo].astype(f32), cos_ref[b, hi].astype(f32)
        s1, s2 = sin_ref[b, lo].astype(f32), sin_ref[b, hi].astype(f32)
        return rd(rd(x1 * c1) - rd(x2 * s1)), rd(rd(x2 * c2) + rd(x1 * s2))

    @pl.when(head < n)
    def _query():
        q1, q2 = rope(*rms_norm(*load(head * h), qn_ref))
        q_ref[b, head, lo] = q1.astype(q_ref.dtype)
        q_ref[b, head, hi] = q2.astype(q_ref.dtype)

    @pl.when(head >= n)
    def _key_value():
        kh = head - n
        slot = slots_ref[b]

        @pl.when(slot < s)
        def _write():
            layer = layer_ref[0]
            k1, k2 = rope(*rms_norm(*load((n + kh) * h), kn_ref))
            v_start = (n + k + kh) * h
            k_out[layer, slot, kh, lo] = k1.astype(k_out.dtype)
            k_out[layer, slot, kh, hi] = k2.astype(k_out.dtype)
            v_out[layer, slot, kh, lo] = qkv_ref[b, pl.ds(v_start, half)].astype(v_out.dtype)
            v_out[layer, slot, kh, hi] = qkv_ref[b, pl.ds(v_start + half, half)].astype(v_out.dtype)


def _compiler_params(knobs: PrologueKnobs, interpret: bool):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=knobs.num_warps, num_stages=knobs.num_stages)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "norm", "eps", "knobs", "interpret"))
def prologue(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
             layer: jax.Array, slots: jax.Array, q_norm_weight: jax.Array | None = None,
             k_norm_weight: jax.Array | None = None, norm_layer: jax.Array | None = None, *, num_heads: int,
             num_kv_heads: int, norm: str | None = None,
             eps: float = 1e-6, knobs: PrologueKnobs = PrologueKnobs(), interpret: bool = False
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (q [B, N, H], k_pool, v_pool with the B slots written). qkv [B, (N + 2K) H]; cos / sin [B, H]; pools
    [L, S, K, H] in qkv's dtype; layer [] int32; slots [B] int32; norm weights [H] with `norm` (both or neither),
    or stacks [R, H] read at row norm_layer ([] int32: a layer stack's, read in place).
    The shapes are api.py's to check; here only what the kernel itself needs."""
    B, width = qkv.shape
    L, S, K, H = k_pool.shape
    N = num_heads
    if K != num_kv_heads or width != (N + 2 * K) * H or not 1 <= B <= MAX_ROWS:
        raise ValueError(f"decode prologue: qkv {qkv.shape} against pools {k_pool.shape}, {N} query heads")
    kernel = functools.partial(_prologue_kernel, n=N, k=K, h=H, s=S, norm=norm, eps=float(eps))
    args = [jnp.reshape(layer, (1,)).astype(jnp.int32), slots.astype(jnp.int32), qkv, cos, sin]
    if norm is not None:
        row = jnp.reshape(0 if norm_layer is None else norm_layer, (1,)).astype(jnp.int32)
        args += [q_norm_weight.reshape(-1), k_norm_weight.reshape(-1), row]
    pools = len(args)
    args += [k_pool, v_pool]
    out_shape = (jax.ShapeDtypeStruct((B, N, H), qkv.dtype), jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                 jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype))
    return pl.pallas_call(kernel, out_shape=out_shape, grid=(B, N + K),
                          input_output_aliases={pools: 1, pools + 1: 2},
                          compiler_params=_compiler_params(knobs, interpret), interpret=interpret,
                          name="decode_prologue" + (f"_{norm}" if norm else ""))(*args)


__all__ = ["MAX_ROWS", "NORMS", "PrologueKnobs", "prologue"]
