"""`chunk_gated_delta_rule(...)`: the gated delta rule over whole rows (training, prefill), the implementation
chosen; `recurrent_gated_delta_step(...)`: one token (decode, jnp: one token is a few small einsums). Semantics
and operands: reference.py.

impl:
    "reference"  the token-by-token scan (reference.py)
    "chunked"    chunks of 64 in pure jnp (chunked.py), gradient by JAX autodiff
    "pallas"     the Pallas kernels (kernel.py), Triton on a GPU, interpret mode elsewhere: a custom_vjp whose
                 forward kernel also saves the state entering each chunk and whose backward kernel walks the chunks
                 in reverse from them
    "pallas_v2"  the forward in flash-linear-attention's layout (kernel_v2.py: a chunk-parallel kernel for the inverse,
                 U and W, a state-only sequential kernel, a chunk-parallel output kernel); a custom_vjp whose
                 backward is four kernels in the same layout (kernel_v2_bwd.py: fla's chunk-backward decomposition,
                 from the forward kernels' saved chunk states and v_new) or backward_v2.py's jnp, their reference
                 (`backward`: "kernels" | "jnp" | "auto" = the kernels on a GPU, 2.9x the jnp measured on an H100,
                 and the jnp elsewhere: `resolve_backward`)
    "auto"       "pallas_v2" on a GPU, "chunked" elsewhere (interpret mode is for tests). Measured on an H100
                 (benchmarks/RESULTS.md session 21, Qwen3.5 shapes, every program checked against the fp32 chunked
                 form; the backward then backward_v2.py's jnp, ~6.1 ms of it at 0.8B: its kernels are not timed
                 yet): forward + backward 8 x 2048 0.8B 6.98 ms against the chunked form's 10.60, 9B 14.40 / 20.80,
                 1 x 8192 4.98 / 8.08 (forward alone 0.87 / 3.63 ms); "pallas" (kernel.py) is 2.6-3.6x slower than
                 "chunked" (session 20) and never chosen
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta import backward_v2, kernel_v2_bwd
from pallas_kernels.gated_delta.chunked import CHUNK, chunk_gated_delta_rule_chunked, pad_to_chunks, segment_numbers
from pallas_kernels.gated_delta.kernel import gated_delta_pallas, gated_delta_pallas_bwd
from pallas_kernels.gated_delta.kernel_v2 import V2Knobs, chunk_forward
from pallas_kernels.gated_delta.reference import gated_delta_rule_reference, recurrent_gated_delta_step

IMPLS = ("auto", "reference", "chunked", "pallas", "pallas_v2")
# launch knobs: untuned guesses (no GPU run yet); the GPU session sweeps them against fla's kernels
BLOCK_V = 32  # value columns of the state per program. An offline sm_90 compile (Triton 3.6) at Dk = Dv = 128: the
#               backward needs 278 KB of shared memory at 64, over a block's 232,448 bytes; at 32 about 229,000 bytes,
#               just under (not yet compiled by XLA's own Triton on a GPU)
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


@dataclasses.dataclass(frozen=True)
class KernelKnobs:
    """The kernels' launch: static (hashable), one per call."""
    scale: float
    interpret: bool
    block_v: int = BLOCK_V
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES

    def kwargs(self) -> dict:
        return dict(scale=self.scale, chunk=CHUNK, block_v=self.block_v, num_warps=self.num_warps,
                    num_stages=self.num_stages, interpret=self.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernels(knobs: KernelKnobs, q, k, v, g, beta, seg, before, state):
    """(o, final state) of padded operands by the forward kernel; the backward kernel is its VJP."""
    return tuple(gated_delta_pallas(q, k, v, g, beta, seg, before, state, **knobs.kwargs()))


def _kernels_fwd(knobs, q, k, v, g, beta, seg, before, state):
    o, final, states = gated_delta_pallas(q, k, v, g, beta, seg, before, state, save_states=True,
                                          **knobs.kwargs())
    return (o, final), (q, k, v, g, beta, seg, before, states, state)


def _kernels_bwd(knobs, residuals, cotangents):
    q, k, v, g, beta, seg, before, states, state = residuals
    do, ds = cotangents
    dq, dk, dv, dg, dbeta, ds0 = gated_delta_pallas_bwd(q, k, v, g, beta, seg, before, states, do.astype(v.dtype),
                                                        ds, **knobs.kwargs())
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv, dg, dbeta, None, None, ds0.astype(state.dtype))


_kernels.defvjp(_kernels_fwd, _kernels_bwd)


def pallas_forward(q, k, v, g, beta, segment_ids, state, *, scale: float, interpret: bool, block_v: int = BLOCK_V,
                   num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
    """(o [B, T, H, Dv], final state [B, H, Dk, Dv] fp32) by the kernels (differentiable: the backward kernel): T
    padded to whole chunks, Dk and Dv to powers of two (zero columns: they neither read nor write the state), then
    cut back."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dk, dv = _pow2(Dk), _pow2(Dv)
    knobs = KernelKnobs(scale=scale, interpret=interpret, block_v=min(block_v, dv), num_warps=num_warps,
                        num_stages=num_stages)
    seg = segment_numbers(segment_ids, (B, T))
    q, k, v, g, beta, seg, before = pad_to_chunks(q, k, v, g, beta, seg)
    q, k = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, dk - Dk))) for x in (q, k))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dv - Dv)))
    state = jnp.pad(state.astype(jnp.float32), ((0, 0), (0, 0), (0, dk - Dk), (0, dv - Dv)))
    o, state = _kernels(knobs, q, k, v, g, beta, seg, before, state)
    return o[:, :T, :, :Dv], state[:, :, :Dk, :Dv]


def v2_operands(q, k, v, g, beta, seg, state):
    """kernel_v2's prepared operands from the API's (seg: segment numbers [B, T]): T padded to whole chunks, Dk
    and Dv to powers of two, gamma the chunk-local cumulative log decay, first / last the packed-row flags."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dk, dv = _pow2(Dk), _pow2(Dv)
    q, k, v, g, beta, seg, before = pad_to_chunks(q, k, v, g, beta, seg)
    Tp = g.shape[1]
    gamma = jnp.cumsum(g.reshape(B, Tp // CHUNK, CHUNK, H), axis=2).reshape(B, Tp, H)
    chunks = seg.reshape(B, Tp // CHUNK, CHUNK)
    first = (chunks == before[..., None]).reshape(B, Tp).astype(jnp.float32)
    last = (chunks == chunks[..., -1:]).reshape(B, Tp).astype(jnp.float32)
    q, k = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, dk - Dk))) for x in (q, k))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dv - Dv)))
    state = jnp.pad(state.astype(jnp.float32), ((0, 0), (0, 0), (0, dk - Dk), (0, dv - Dv)))
    return q, k, v, gamma, beta, seg.astype(jnp.int32), first, last, state


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def pallas_v2_forward(knobs: V2Knobs, q, k, v, g, beta, seg, state):
    """(o [B, T, H, Dv], final state [B, H, Dk, Dv] fp32) by kernel_v2's three kernels; seg: segment numbers
    [B, T]. Differentiable: `_v2_bwd`."""
    T, Dk, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    o, final = chunk_forward(*v2_operands(q, k, v, g, beta, seg, state), knobs=knobs, chunk=CHUNK)
    return o[:, :T, :, :Dv], final[:, :, :Dk, :Dv]


def _v2_fwd(knobs, q, k, v, g, beta, seg, state):
    T, Dk, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    o, final, h, v_new = chunk_forward(*v2_operands(q, k, v, g, beta, seg, state), knobs=knobs, chunk=CHUNK,
                                       save_states=True)
    return (o[:, :T, :, :Dv], final[:, :, :Dk, :Dv]), (q, k, v, g, beta, seg, state, h, v_new)


def _v2_bwd(knobs, residuals, cotangents):
    """kernel_v2_bwd's four kernels (fla's chunk-backward decomposition) from the forward kernels' saved h and
    v_new, T and W recomputed from the operands. In interpret mode backward_v2.py's jnp, their specification,
    instead: the kernels interpreted cost the CPU suite ~6 s more (measured: the two gradient tests of
    test_gated_delta.py), and test_v2_backward_kernels_match_jnp checks them against it."""
    q, k, v, g, beta, seg, state, h, v_new = residuals
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    prepared = v2_operands(q, k, v, g, beta, seg, state)
    Tp, dk, dv = prepared[0].shape[1], prepared[0].shape[-1], prepared[2].shape[-1]
    do, ds = cotangents
    do = jnp.pad(do.astype(v.dtype), ((0, 0), (0, Tp - T), (0, 0), (0, dv - Dv)))
    ds = jnp.pad(ds.astype(jnp.float32), ((0, 0), (0, 0), (0, dk - Dk), (0, dv - Dv)))
    if knobs.interpret or knobs.backward == "jnp":
        grads = backward_v2.chunk_backward(*prepared[:-1], h, v_new, do, ds, scale=knobs.scale, chunk=CHUNK)
    else:
        grads = kernel_v2_bwd.chunk_backward(*prepared[:-1], h, v_new, do, ds, knobs=knobs, chunk=CHUNK)
    dq, dk_, dv_, dg, dbeta, ds0 = grads
    return (dq[:, :T, :, :Dk].astype(q.dtype), dk_[:, :T, :, :Dk].astype(k.dtype), dv_[:, :T, :, :Dv].astype(v.dtype),
            dg[:, :T].astype(g.dtype), dbeta[:, :T].astype(beta.dtype), None, ds0[:, :, :Dk, :Dv].astype(state.dtype))


pallas_v2_forward.defvjp(_v2_fwd, _v2_bwd)


BACKWARDS = ("auto", "kernels", "jnp")  # impl pallas_v2's backward (module docstring)


def resolve_backward(backward: str) -> str:
    """impl pallas_v2's backward: "auto" is kernel_v2_bwd.py's kernels on a GPU and backward_v2.py's jnp elsewhere
    (interpret mode is slow). Measured on an H100 (session 23, RESULTS.md): the kernels pass
    tests/pallas_kernels/test_gated_delta_gpu.py compiled (fp32 and bf16) and take 2.18 ms against the jnp's 6.2 at
    Qwen3.5-0.8B 8 x 2048; the 0.8B LoRA step goes from 54.4k to 69.3k tokens/s (1.27x) and its peak from 43.3 to
    39.6 GiB."""
    if backward not in BACKWARDS:
        raise ValueError(f"chunk_gated_delta_rule: backward {backward!r} is unknown ({', '.join(BACKWARDS)})")
    if backward == "auto":
        return "kernels" if jax.default_backend() == "gpu" else "jnp"
    return backward


def resolve_impl(impl: str) -> str:
    """The implementation `impl` runs on this process's default backend: "auto" is "pallas_v2" on a GPU and
    "chunked" elsewhere (measured: module docstring); the others are themselves. The memory plan reads it too
    (each form saves different residuals for its backward)."""
    if impl not in IMPLS:
        raise ValueError(f"chunk_gated_delta_rule: impl {impl!r} is unknown ({', '.join(IMPLS)})")
    if impl == "auto":
        return "pallas_v2" if jax.default_backend() == "gpu" else "chunked"
    return impl


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "impl", "interpret", "backward"))
def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float, segment_ids=None, initial_state=None,
                           output_final_state: bool = False, impl: str = "auto", interpret: bool | None = None,
                           backward: str = "auto"):
    """(o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] fp32 or None): reference.py's operands.
    interpret (impl "pallas", "pallas_v2"): None = interpret mode on any backend but GPU. backward (impl
    "pallas_v2"): `BACKWARDS`."""
    impl = resolve_impl(impl)
    _check(q, k, v, g, beta, segment_ids, initial_state)
    on_gpu = jax.default_backend() == "gpu"
    kwargs = dict(scale=scale, segment_ids=segment_ids, initial_state=initial_state,
                  output_final_state=output_final_state)
    if impl == "reference":
        return gated_delta_rule_reference(q, k, v, g, beta, **kwargs)
    if impl == "chunked":
        return chunk_gated_delta_rule_chunked(q, k, v, g, beta, **kwargs)
    B, T, H, Dk = q.shape
    state = jnp.zeros((B, H, Dk, v.shape[-1]), jnp.float32) if initial_state is None else initial_state
    interpret = not on_gpu if interpret is None else interpret
    if impl == "pallas_v2":
        knobs = V2Knobs(scale=scale, interpret=interpret, backward=resolve_backward(backward))
        o, state = pallas_v2_forward(knobs, q, k, v, g, beta, segment_numbers(segment_ids, (B, T)), state)
        return o, (state if output_final_state else None)
    o, state = pallas_forward(q, k, v, g, beta, segment_ids, state, scale=scale,
                              interpret=interpret)
    return o, (state if output_final_state else None)


__all__ = ["IMPLS", "chunk_gated_delta_rule", "pallas_forward", "pallas_v2_forward", "recurrent_gated_delta_step",
           "resolve_backward", "resolve_impl", "v2_operands"]
