"""The pure-jnp reference of the gathered quantised GEMV (quant_kernel.py): gather the A experts' layout arrays
from the stack, decode each (pallas_kernels.quant_matmul.reference.dequantize_layout, the fused kernels' own
reference decoding), cast to x's dtype and multiply row by row with fp32 accumulation, y in x's dtype. It is also
the XLA path a server takes off the GPU (surojax.quant.expert_stack.LaidOutExperts)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul.layout import KernelLayout
from pallas_kernels.quant_matmul.reference import dequantize_layout


def gathered_layout_ref(x: jax.Array, stack: KernelLayout, expert_ids: jax.Array, base: jax.Array | int = 0
                        ) -> jax.Array:
    """y [A, N], y[a] = x[a] @ decode(stack[base + expert_ids[a]]) (stack arrays [R, ...], x [A, K])."""
    rows = jnp.asarray(base, jnp.int32).reshape(()) + expert_ids.astype(jnp.int32)
    take = lambda arr: None if arr is None else jnp.take(arr, rows, axis=0)  # noqa: E731
    gathered = dataclasses.replace(stack, codes=take(stack.codes), scale=take(stack.scale),
                                   offset=take(stack.offset))
    w = jax.vmap(dequantize_layout)(gathered)  # [A, K, N] fp32
    y = jnp.einsum("ak,akn->an", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


__all__ = ["gathered_layout_ref"]
