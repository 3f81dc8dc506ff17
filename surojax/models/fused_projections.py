"""Serving transform: the projections that read the same input become one GEMM each.

    fuse_projections(model)   attn.q_proj / k_proj / v_proj -> attn.qkv_proj  [L, D, (N + 2K) H]
                              mlp.gate_proj / up_proj       -> mlp.gate_up_proj [L, D, 2F] (gate columns first)
                              linear_attn.in_proj_qkv / _z / _b / _a -> linear_attn.in_proj_qkvzba
                                  [L, D, conv_dim + Hv Dv + 2 Hv] (a Gated DeltaNet's four input projections)
    in every layer stack of the model (a hybrid's `layers` and `linear_layers`).

A decode step multiplies one row per running sequence by every weight of every layer. At 1-16 rows a product
is a few microseconds of memory traffic and a launch: Qwen3-0.6B's one-user token step is ~32 short kernels per
layer (benchmarks/RESULTS.md#s12). Joining the kernels that share an input along the output
axis turns five of the layer's seven GEMVs into two: x is read once, and each kernel reads a weight 1.5-3x the
size, where a launch amortises better. Prefill gets one wider GEMM instead of three or two.

The joined kernel holds the same values side by side, so each output column is the same dot product as before;
results may differ only where the GEMM's blocking orders a column's K sum differently (one rounding of the
compute dtype). Joined: plain kernels of one dtype, and weights that can join columns themselves
(`join_columns`: surojax.quant.laid_out.LaidOut of one layout, surojax.quant.gemv_weight.GemvWeight of one dtype). Left as they are: LoRA-wrapped or quantised
parts (GGUF blocks, a Q4_K / Q6_K mix), MoE experts. The parts' names are gone afterwards (checkpoints,
adapters, exports name them), so this is for a model that only serves: `surojax serve` without LoRA slots and
`surojax generate` call it after laying out the decode kernels' weights (surojax.quant.laid_out.decode_weights).
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from surojax.models.layers.linear import Linear

log = logging.getLogger("surojax.models")

FUSED = {("attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
         ("linear_attn", "in_proj_qkvzba"): ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}


def _join_columns(values: list):
    """The kernels [..., K, N_i] side by side along N, or None when they cannot be joined."""
    first = values[0]
    if hasattr(first, "join_columns"):
        return first.join_columns(values)
    if not all(isinstance(v, jax.Array) for v in values):
        return None
    if len({(v.dtype, v.shape[:-1]) for v in values}) != 1:
        return None
    return jnp.concatenate(values, axis=-1)


def _fuse(holder, parts: tuple[str, ...], fused: str) -> bool:
    linears = [getattr(holder, name, None) for name in parts]
    if any(type(lin) is not Linear for lin in linears):  # LoRA-wrapped, a recipe's own Linear, absent (MoE)
        return False
    kernel = _join_columns([lin.kernel.get_value() for lin in linears])
    if kernel is None:
        return False
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return False
    head = linears[0]  # becomes the joined Linear: its kernel's variable class and metadata carry over
    head.kernel = type(head.kernel)(kernel, **head.kernel.get_metadata())
    if biases[0] is not None:
        head.bias = type(head.bias)(jnp.concatenate([b.get_value() for b in biases], axis=-1),
                                    **head.bias.get_metadata())
    head.out_features = sum(lin.out_features for lin in linears)
    setattr(holder, fused, head)
    for name in parts:
        setattr(holder, name, None)
    return True


def fuse_projections(model) -> list[str]:
    """Join, in place, the decoder's q / k / v, gate / up and Gated DeltaNet input kernels in every layer stack
    (module docstring); idempotent. -> the joined modules' names ("qkv_proj", "gate_up_proj", "in_proj_qkvzba"),
    each once."""
    done = []
    stacks = model.stacks if hasattr(model, "stacks") else {"layers": model.layers}
    for stack in stacks.values():
        for (block, fused), parts in FUSED.items():
            holder = getattr(stack, block, None)
            if holder is not None and getattr(holder, fused, None) is None and _fuse(holder, parts, fused):
                if fused not in done:
                    done.append(fused)
    if done:
        log.info("projections joined for serving: %s", ", ".join(done))
    return done


__all__ = ["FUSED", "fuse_projections"]
