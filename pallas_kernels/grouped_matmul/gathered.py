"""`gathered_dot(x, w, expert_ids)`: the few-rows form of the MoE expert matmul, reading only the routed experts.

    x [A, I] (one row per assignment, any order), w [E, I, O], expert_ids [A] int
    -> y [A, O],  y[a] = x[a] @ w[expert_ids[a]]

The grouped GEMM (`grouped_dot`, api.py) runs over all E groups: at a decode step of one user (A = k assignments
against E = 128 experts on Qwen3-30B-A3B) it reads, or at least launches over, every expert's weights for a
handful of rows. Here each assignment's expert matrix is gathered first (`jnp.take` along E: A matrices of I x O
cross HBM instead of E) and multiplied with its own row (a batched matrix-vector product). An expert routed by
several assignments is gathered once per assignment: the path is meant for A small against E, where the
caller's crossover sends it (surojax.models.layers.moe.GATHER_CROSSOVER).

Same math as the grouped path: w is cast to x's dtype, products accumulate in fp32 (`preferred_element_type`),
y is cast back to x's dtype. Differentiable: the gradient of the gather is a scatter-add into w's E rows.

A quantised weight (any pytree with `take_experts(ids)` and `dequantize(dtype)`, surojax.quant's formats) is
gathered in its packed form (codes and scales of the A experts only) and dequantised after the gather, so the
bytes read are the active experts' quantised bytes. Imports nothing from surojax.

`kernel` (the caller's mode: surojax passes SUROJAX_MOE_GATHER_KERNEL): "pallas" sends a plain float w on a GPU
to the gathered GEMV kernel (pallas_kernels.gathered_gemv: each routed expert's tiles read in place, no gathered
copy written; the same math, only the summation order differs); off a GPU, or for a quantised w, this XLA path
runs whatever the mode. "auto" and "xla" keep the XLA path (the kernel is unmeasured). Differentiated, the kernel
call has this path's gradient (`_kernel_dot`'s backward is the XLA path's VJP), so training is unchanged.
`layer`: w is a layer stack [L, E, I, O] read in place at that layer (a served model's experts handed whole to the
layer scan, surojax.quant.expert_stack): the kernel offsets its expert rows, XLA gathers rows layer x E + id.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gathered_gemv.api import choose, gathered_gemv


def rowwise_dot(x: jax.Array, w_rows: jax.Array) -> jax.Array:
    """x [A, I] @ w_rows [A, I, O] row by row -> [A, O] in x's dtype (w cast to x's dtype, fp32 accumulation)."""
    y = jnp.einsum("ai,aio->ao", x, w_rows.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _xla_dot(x: jax.Array, w: jax.Array, expert_ids: jax.Array, layer) -> jax.Array:
    """XLA's gather of the A experts (from the layer stack at layer x E + id: one gather, no slice) and product."""
    if layer is not None:
        expert_ids = jnp.asarray(layer, jnp.int32) * w.shape[1] + expert_ids
        w = w.reshape(-1, *w.shape[2:])  # [L E, I, O]
    return rowwise_dot(x, jnp.take(w, expert_ids, axis=0))


@jax.custom_vjp
def _kernel_dot(x: jax.Array, w: jax.Array, expert_ids: jax.Array, layer) -> jax.Array:
    """The gathered GEMV kernel's forward, the XLA path's backward (the kernel is for serving decode)."""
    return gathered_gemv(x, w, expert_ids, layer=layer)


def _kernel_fwd(x, w, expert_ids, layer):
    return _kernel_dot(x, w, expert_ids, layer), (x, w, expert_ids, layer)


def _kernel_bwd(res, g):
    x, w, expert_ids, layer = res
    _, vjp = jax.vjp(lambda x, w: _xla_dot(x, w, expert_ids, layer), x, w)
    return (*vjp(g), None, None)


_kernel_dot.defvjp(_kernel_fwd, _kernel_bwd)


def gathered_dot(x: jax.Array, w, expert_ids: jax.Array, *, layer: jax.Array | int | None = None,
                 kernel: str = "xla") -> jax.Array:
    """y[a] = x[a] @ w[expert_ids[a]] -> [A, O] in x's dtype (module docstring). w: [E, I, O], a layer stack
    [L, E, I, O] read at `layer` in place, or a quantised pytree of E stacked experts (`take_experts`); kernel:
    auto | pallas | xla (pallas_kernels.gathered_gemv.choose: the kernel for a plain w on a GPU under pallas)."""
    path = choose(w, kernel)  # refuses a mode it does not know, whatever w is
    if x.ndim != 2 or expert_ids.shape != (x.shape[0],) or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"gathered_dot: x {x.shape} [A, I], expert_ids {expert_ids.shape} {expert_ids.dtype} "
                         "[A] integers")
    if hasattr(w, "take_experts"):
        if layer is not None:
            raise ValueError("gathered_dot: a layer index with a quantised weight (it takes its own experts)")
        w_rows = w.take_experts(expert_ids).dequantize(x.dtype)  # [A, I, O]: only the A experts' blocks decoded
        if w_rows.shape[:2] != x.shape:
            raise ValueError(f"gathered_dot: x {x.shape} [A, I], the gathered experts {w_rows.shape} [A, I, O]")
        return rowwise_dot(x, w_rows)
    if w.ndim != (3 if layer is None else 4) or w.shape[-2] != x.shape[1]:
        raise ValueError(f"gathered_dot: x {x.shape} [A, I], w {w.shape} [E, I, O] (or [L, E, I, O] with a layer "
                         f"index: {layer is not None})")
    if path == "pallas":
        return _kernel_dot(x, w, expert_ids, layer)
    return _xla_dot(x, w, expert_ids, layer)


__all__ = ["gathered_dot", "rowwise_dot"]
