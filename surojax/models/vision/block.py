"""One vision block (transformers' Qwen3VLVisionBlock): x + attn(norm1(x)), then + mlp(norm2(x)).

Attention: one fused qkv projection [D, 3D] with bias, heads of D / num_heads, the 2-D rotary on q and k (the first
half of each head's frequencies from the patch row, the second half from the column, both halves repeated as
rotate_half expects; applied in fp32), non-causal softmax attention (fp32 softmax) within each frame only
(`segment_ids`), output projection with bias. MLP: fc1 -> hidden_act -> fc2, both with bias.

Per-frame attention without the [heads, N, N] matrix (`frame_attention`): the host's `attention_layout` [R, L]
(grid.py: whole frames packed into R rows of L slots) gathers q, k, v into [R, L, heads, hd]; each row attends with
its frames' segment mask ([heads, R, L, L] scores, O(N * L) for N patches and frames of at most L), and the outputs
go back to their patches by a scatter. A real patch's softmax runs over exactly its frame's keys, as the dense
masked form did (the masked entries were exp(-inf) = 0). Empty slots share the segment -1 (finite, dropped); a
padding patch no row holds gets zeros. With `cudnn` (the decoder's attention backend resolved to cudnn) and a
bf16 / fp16 compute dtype, the rows go to cuDNN's fused attention through jax.nn.dot_product_attention with the
segment mask [R, 1, L, L] (no [heads, R, L, L] scores in memory); otherwise the einsum form above (fp32 softmax).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.layers.linear import Linear
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.layer_norm import LayerNorm

ACTIVATION = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
              "gelu": lambda x: jax.nn.gelu(x, approximate=False),
              "silu": jax.nn.silu,
              "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}


def rotary_inv_freq(cfg: VisionConfig) -> np.ndarray:
    """[head_dim / 4] inverse frequencies, shared by the row and the column axis (transformers' axial rope)."""
    spatial = cfg.head_dim // 2
    return (1.0 / (cfg.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))).astype(np.float32)


def rotary_cos_sin(positions: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """positions [N, 2] (row, col) -> cos, sin [N, head_dim] in fp32: [row freqs | col freqs] twice."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rotary_inv_freq(cfg))  # [N, 2, hd/4]
    angles = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, H, hd] rotated in fp32 (rotate_half convention), cast back."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        d = cfg.hidden_size
        self.qkv = Linear(d, 3 * d, ("embed", "heads"), use_bias=True, param_dtype=param_dtype, rngs=rngs)
        self.proj = Linear(d, d, ("heads", "embed"), use_bias=True, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 layout: jax.Array, cudnn: bool = False) -> jax.Array:
        n = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim), 1, 0)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        fused = "cudnn" if cudnn and q.dtype in (jnp.bfloat16, jnp.float16) else None
        out = frame_attention(q, k, v, segment_ids, layout, self.head_dim ** -0.5, implementation=fused)
        return self.proj(out.reshape(n, -1))


def frame_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, layout: jax.Array,
                    scale: float, implementation: str | None = None) -> jax.Array:
    """q, k, v [N, heads, hd], segment_ids [N], layout [R, L] (-1 = empty) -> [N, heads, hd]: softmax attention
    within each frame, computed row by row of the layout (module docstring). implementation: None the einsum form;
    "cudnn" / "xla" jax.nn.dot_product_attention's."""
    n = q.shape[0]
    slots = jnp.where(layout < 0, n, layout)  # out of range: gathers zeros, scatters nothing

    def rows(t):
        return jnp.take(t, slots, axis=0, mode="fill", fill_value=0)  # [R, L, ...]

    segments = rows(segment_ids.astype(jnp.int32) + 1) - 1  # empty slots -> -1
    same_frame = segments[:, :, None] == segments[:, None, :]
    if implementation is not None:
        out = jax.nn.dot_product_attention(rows(q), rows(k), rows(v), mask=same_frame[:, None], scale=scale,
                                           implementation=implementation)
        return jnp.zeros_like(q).at[slots].set(out, mode="drop")
    scores = jnp.einsum("rqhd,rkhd->rhqk", rows(q), rows(k)) * jnp.asarray(scale, q.dtype)
    scores = jnp.where(same_frame[:, None], scores.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("rhqk,rkhd->rqhd", probs, rows(v))
    return jnp.zeros_like(q).at[slots].set(out, mode="drop")


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.act = ACTIVATION[cfg.hidden_act]
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"), use_bias=True,
                                 param_dtype=param_dtype, rngs=rngs)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, ("mlp", "embed"), use_bias=True,
                                 param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ("embed",), param_dtype=param_dtype)
        self.norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ("embed",), param_dtype=param_dtype)
        self.attn = VisionAttention(cfg, param_dtype=param_dtype, rngs=rngs)
        self.mlp = VisionMLP(cfg, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 layout: jax.Array, cudnn: bool = False) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids, layout, cudnn)
        return x + self.mlp(self.norm2(x))
