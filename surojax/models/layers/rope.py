"""Rotary position embedding, HF's non-interleaved ("rotate_half") convention.

The inverse frequencies (with llama3 / linear scaling) are computed once on the host; angles are
positions * inv_freq in fp32; cos/sin are cast to the activation dtype before use, as in transformers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from surojax.models.config import ModelConfig, llama3_inv_freq


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    return np.asarray(llama3_inv_freq(cfg), np.float32)  # [H/2]


def rope_cos_sin(positions: jax.Array, inv_freq_h: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> cos, sin [B, T, H] (the H/2 frequencies repeated twice)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_h)  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H]; cos/sin [B, T, H]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
