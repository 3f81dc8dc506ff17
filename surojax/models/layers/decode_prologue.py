"""The fused decode prologue of an attention layer (SUROJAX_DECODE_PROLOGUE=pallas): at a decode call over the
serving pool, one Pallas kernel (pallas_kernels/decode_prologue) takes the joined QKV projection's output and does
what Attention.__call__ otherwise does op by op before the attention: the split into q / k / v, the per-head q and
k RMSNorm, rope on both and the write of k / v into the pool.

It applies to a call that is a plain decode: one token per row, at most 8 rows, through a `PagedLayerKV` that is
not a fresh call (a prefill attends over its own new tokens), holds the compute dtype (no FP8 scales) and maps no
KV-shared rows, from a layer with a joined qkv projection, full rope, and no output gate, v norm, sinks or KV
sharing. Any other call takes the op-by-op path: nothing is refused.
"""
from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.decode_prologue import choose, decode_prologue, unsupported
from surojax.kernel_settings import kernel_settings
from surojax.models.kv import PagedKVMeta, PagedLayerKV
from surojax.models.layers.stacked_vector import in_place


def _applies(attn, qkv: jax.Array, cos: jax.Array, kv) -> bool:
    if not isinstance(kv, PagedLayerKV) or kv.fresh or kv.scales is not None or kv.rows is not None:
        return False
    if attn.output_gate or attn.kv_shared or attn.v_norm_eps is not None or attn.sinks is not None:
        return False
    if (attn.q_norm is None) != (attn.k_norm is None):
        return False
    if attn.q_norm is not None and (attn.q_norm.eps != attn.k_norm.eps
                                    or attn.q_norm.zero_centered != attn.k_norm.zero_centered):
        return False
    B, T, width = qkv.shape
    return T == 1 and unsupported(B, width, attn.num_heads, kv.k.shape, qkv.dtype, kv.k.dtype, cos.shape[-1]) is None


def fused_decode_prologue(attn, qkv: jax.Array, cos: jax.Array, sin: jax.Array, kv,
                          meta: PagedKVMeta | None) -> tuple[jax.Array, PagedLayerKV] | None:
    """attn: the `Attention` layer; qkv [B, 1, (N + 2K) H] its joined projection's output; cos / sin [B, 1, H];
    kv / meta the call's cache view and metadata -> (q [B, 1, N, H] normed and rotated, kv with the new k / v
    written), or None where the setting or the call says the op-by-op path (module docstring)."""
    if choose(kernel_settings().decode_prologue.value) != "pallas" or not _applies(attn, qkv, cos, kv):
        return None
    norm = {}
    if attn.q_norm is not None:  # the scales as stored: a layer stack's StackedVectors are read in place (both at
        # the layer's row: norms_in_place converts every norm of the stack)
        (qw, layer), (kw, _) = in_place(attn.q_norm.scale.get_value()), in_place(attn.k_norm.scale.get_value())
        norm = dict(q_norm_weight=qw, k_norm_weight=kw, norm_layer=layer, eps=attn.q_norm.eps,
                    norm="zero_centered" if attn.q_norm.zero_centered else "plain")
    q, k_pool, v_pool = decode_prologue(qkv[:, 0], cos[:, 0], sin[:, 0], kv.k, kv.v, kv.pool_row,
                                        meta.write_slots[:, 0], num_heads=attn.num_heads, **norm)
    return q[:, None], dataclasses.replace(kv, k=k_pool, v=v_pool)


__all__ = ["fused_decode_prologue"]
