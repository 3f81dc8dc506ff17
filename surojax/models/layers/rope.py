"""Rotary position embedding, HF's non-interleaved ("rotate_half") convention.

The inverse frequencies (default, linear, llama3 or yarn scaling) are computed once on the host; angles are
positions * inv_freq in fp32; cos/sin are multiplied by the rope's attention factor (yarn's mscale, 1
otherwise) in fp32 and then cast to the activation dtype, as in transformers. Partial rope (Qwen3.5's
partial_rotary_factor): cos/sin cover the first `rotary_dim` dims of each head; the rest passes unrotated.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from surojax.models.config import ModelConfig, rope_attention_factor, rope_inv_freq


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    return np.asarray(rope_inv_freq(cfg), np.float32)  # [H/2]


def attention_factor(cfg: ModelConfig) -> float:
    """The scale of cos and sin (yarn's mscale; 1 for the other rope types)."""
    return rope_attention_factor(cfg)


def rope_cos_sin(positions: jax.Array, inv_freq_h: np.ndarray, dtype,
                 scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> cos, sin [B, T, H] (the H/2 frequencies repeated twice), each times `scale` (fp32)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_h)  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H]; cos/sin [B, T, H] (or [B, T, R], R < H: the first R dims rotate, the others pass)."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :R], cos, sin), x[..., R:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
