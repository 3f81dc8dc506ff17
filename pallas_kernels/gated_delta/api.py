"""`chunk_gated_delta_rule(...)`: the gated delta rule over whole rows (training, prefill), the implementation
chosen; `recurrent_gated_delta_step(...)`: one token (decode, jnp: one token is a few small einsums). Semantics
and operands: reference.py.

impl:
    "reference"  the token-by-token scan (reference.py)
    "chunked"    chunks of 64 in pure jnp (chunked.py), gradient by JAX autodiff
    "pallas"     the Pallas kernel (kernel.py) forward, Triton on a GPU, interpret mode elsewhere; its backward is
                 NOT a kernel yet: the custom_vjp's backward recomputes the chunked jnp form and differentiates it
                 (jax.vjp of chunked.py), which is exact but costs the chunked form's forward and backward in XLA
    "auto"       "pallas" on a GPU, "chunked" elsewhere
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunked import CHUNK, chunk_gated_delta_rule_chunked, pad_to_chunks, segment_numbers
from pallas_kernels.gated_delta.kernel import gated_delta_pallas
from pallas_kernels.gated_delta.reference import gated_delta_rule_reference, recurrent_gated_delta_step

IMPLS = ("auto", "reference", "chunked", "pallas")
BLOCK_V = 64  # value columns of the state per program
NUM_WARPS = 4
NUM_STAGES = 1


def _check(q, k, v, g, beta, segment_ids, initial_state) -> None:
    """Operand shapes, checked before any work: a mismatch names the operand and the shape expected."""
    if q.ndim != 4:
        raise ValueError(f"chunk_gated_delta_rule: q has shape {q.shape}, expected [B, T, H, Dk]")
    B, T, H, Dk = q.shape
    Dv = v.shape[-1] if v.ndim == 4 else None
    expected = {"k": (k, (B, T, H, Dk)), "v": (v, (B, T, H, Dv)), "g": (g, (B, T, H)), "beta": (beta, (B, T, H))}
    if segment_ids is not None:
        expected["segment_ids"] = (segment_ids, (B, T))
    if initial_state is not None:
        expected["initial_state"] = (initial_state, (B, H, Dk, Dv))
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"chunk_gated_delta_rule: {name} has shape {tuple(x.shape)}, expected {shape} "
                             f"(q is [B, T, H, Dk] = {tuple(q.shape)})")


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())  # Triton's blocks: powers of two, dots of at least 16


def pallas_forward(q, k, v, g, beta, segment_ids, state, *, scale: float, interpret: bool, block_v: int = BLOCK_V,
                   num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
    """(o [B, T, H, Dv], final state [B, H, Dk, Dv] fp32) by the kernel: T padded to whole chunks, Dk and Dv to
    powers of two (zero columns: they neither read nor write the state), then cut back."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dk, dv = _pow2(Dk), _pow2(Dv)
    bv = min(block_v, dv)
    seg = segment_numbers(segment_ids, (B, T))
    q, k, v, g, beta, seg, before = pad_to_chunks(q, k, v, g, beta, seg)
    q, k = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, dk - Dk))) for x in (q, k))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dv - Dv)))
    state = jnp.pad(state.astype(jnp.float32), ((0, 0), (0, 0), (0, dk - Dk), (0, dv - Dv)))
    o, state = gated_delta_pallas(q, k, v, g, beta, seg, before, state, scale=scale, chunk=CHUNK, block_v=bv,
                                  num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return o[:, :T, :, :Dv], state[:, :, :Dk, :Dv]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _pallas_rule(q, k, v, g, beta, segment_ids, state, scale, interpret):
    return pallas_forward(q, k, v, g, beta, segment_ids, state, scale=scale, interpret=interpret)


def _pallas_rule_fwd(q, k, v, g, beta, segment_ids, state, scale, interpret):
    out = pallas_forward(q, k, v, g, beta, segment_ids, state, scale=scale, interpret=interpret)
    return out, (q, k, v, g, beta, segment_ids, state)


def _pallas_rule_bwd(scale, interpret, residuals, cotangents):
    """The backward through the chunked jnp form (recomputed): exact, not yet a kernel (module docstring)."""
    q, k, v, g, beta, segment_ids, state = residuals

    def chunked(q, k, v, g, beta, state):
        return chunk_gated_delta_rule_chunked(q, k, v, g, beta, scale=scale, segment_ids=segment_ids,
                                              initial_state=state, output_final_state=True)

    _, vjp = jax.vjp(chunked, q, k, v, g, beta, state)
    return _with_none(vjp(cotangents))


def _with_none(grads):
    """(dq, dk, dv, dg, dbeta, dstate) -> the custom_vjp's cotangents, None for segment_ids."""
    dq, dk, dv, dg, dbeta, dstate = grads
    return dq, dk, dv, dg, dbeta, None, dstate


_pallas_rule.defvjp(_pallas_rule_fwd, _pallas_rule_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "impl", "interpret"))
def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float, segment_ids=None, initial_state=None,
                           output_final_state: bool = False, impl: str = "auto", interpret: bool | None = None):
    """(o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] fp32 or None): reference.py's operands.
    interpret (impl "pallas"): None = interpret mode on any backend but GPU."""
    if impl not in IMPLS:
        raise ValueError(f"chunk_gated_delta_rule: impl {impl!r} is unknown ({', '.join(IMPLS)})")
    _check(q, k, v, g, beta, segment_ids, initial_state)
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu else "chunked"
    kwargs = dict(scale=scale, segment_ids=segment_ids, initial_state=initial_state,
                  output_final_state=output_final_state)
    if impl == "reference":
        return gated_delta_rule_reference(q, k, v, g, beta, **kwargs)
    if impl == "chunked":
        return chunk_gated_delta_rule_chunked(q, k, v, g, beta, **kwargs)
    B, T, H, Dk = q.shape
    state = jnp.zeros((B, H, Dk, v.shape[-1]), jnp.float32) if initial_state is None else initial_state
    segments = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    o, state = _pallas_rule(q, k, v, g, beta, segments, state, scale, not on_gpu if interpret is None else interpret)
    return o, (state if output_final_state else None)


__all__ = ["IMPLS", "chunk_gated_delta_rule", "pallas_forward", "recurrent_gated_delta_step"]
