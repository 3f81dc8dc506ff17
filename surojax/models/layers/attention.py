"""Grouped-query self-attention over packed rows, with an optional plain KV cache.

Packing: every token carries a segment id (0 = padding) and its position inside its own segment. Query t
sees key s only when both are in the same segment and pos[s] <= pos[t] (and, with a sliding window W,
pos[t] - pos[s] < W), so a packed row computes exactly what each of its sequences computes alone.

Backends (picked by name): `xla` (einsum + masked softmax, any device) and `cudnn` (fused flash attention
through `jax.nn.dot_product_attention`, GPU only). `auto` picks cudnn on GPU and xla elsewhere.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.layers.linear import Linear
from surojax.models.layers.norm import RMSNorm
from surojax.models.layers.rope import apply_rope

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(q_seg, kv_seg, q_pos, kv_pos, sliding_window: int | None = None) -> jax.Array:
    """[B, T] x [B, S] segment ids and positions -> boolean mask [B, T, S] (True = may attend)."""
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    causal = kv_pos[:, None, :] <= q_pos[:, :, None]
    mask = same & causal
    if sliding_window is not None:
        mask &= (q_pos[:, :, None] - kv_pos[:, None, :]) < sliding_window
    return mask


def xla_attention(q, k, v, mask, scale: float) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S] -> [B, T, N, H]. Softmax in fp32."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, T, S]
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return out.reshape(B, T, N, H)


def cudnn_attention(q, k, v, mask, scale: float) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn")


BACKENDS = {"xla": xla_attention, "cudnn": cudnn_attention}


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "cudnn" if jax.default_backend() == "gpu" else "xla"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; expected one of auto, {', '.join(BACKENDS)}")
    return name


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    """One layer's cache slice: k, v [B, S, K, H]."""

    k: jax.Array
    v: jax.Array


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, backend: str = "auto", param_dtype, rngs: nnx.Rngs | None = None):
        D, H = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, H
        self.sliding_window = cfg.sliding_window
        self.backend = resolve_backend(backend)
        bias = cfg.attention_bias
        self.q_proj = Linear(D, cfg.q_dim, ("embed", "heads"), use_bias=bias, param_dtype=param_dtype, rngs=rngs)
        self.k_proj = Linear(D, cfg.kv_dim, ("embed", "kv_heads"), use_bias=bias, param_dtype=param_dtype, rngs=rngs)
        self.v_proj = Linear(D, cfg.kv_dim, ("embed", "kv_heads"), use_bias=bias, param_dtype=param_dtype, rngs=rngs)
        self.o_proj = Linear(cfg.q_dim, D, ("heads", "embed"), param_dtype=param_dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype, rngs=rngs)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cos, sin, segment_ids, positions, kv: LayerKV | None = None, kv_meta=None):
        """x [B, T, D]; cos/sin [B, T, H]; segment_ids/positions [B, T].

        With a cache: `kv` holds this layer's k/v [B, S, K, H] and `kv_meta` = (write_slots [B, T],
        kv_segment_ids [B, S], kv_positions [B, S]) already updated for the new tokens. Returns (y, kv).
        """
        B, T, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(B, T, N, H)
        k = self.k_proj(x).reshape(B, T, K, H)
        v = self.v_proj(x).reshape(B, T, K, H)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            kv_seg, kv_pos = segment_ids, positions
        else:
            slots, kv_seg, kv_pos = kv_meta
            rows = jnp.arange(B)[:, None]
            kv = LayerKV(kv.k.at[rows, slots].set(k.astype(kv.k.dtype)), kv.v.at[rows, slots].set(v.astype(kv.v.dtype)))
            k, v = kv.k.astype(q.dtype), kv.v.astype(q.dtype)
        mask = attention_mask(segment_ids, kv_seg, positions, kv_pos, self.sliding_window)
        out = BACKENDS[self.backend](q, k, v, mask, H ** -0.5)  # [B, T, N, H]
        return self.o_proj(out.reshape(B, T, N * H)), kv
