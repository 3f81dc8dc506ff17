"""`VisionTower`: transformers 5.17's Qwen3VLVisionModel (and Qwen3_5VisionModel: the same without deepstack).

pixel_values [N, C * T * P * P] (the image processor's rows, merge-block order)
  -> patch_embed: the Conv3d whose kernel equals its stride is a linear map of each row (kernel [C*T*P*P, D], bias)
  -> + learned positions: the side x side table resampled bilinearly to each frame's grid (`grid.py`'s taps)
  -> blocks (2-D rotary from each patch's row / col; attention within a frame, on grid.py's attention layout)
     after block i in deepstack_visual_indexes: deepstack merger j -> features j [N / m^2, out_hidden_size]
  -> merger -> [N / m^2, out_hidden_size]: one row per image placeholder token of the language model.

`VisionOutput.merged` replaces the placeholder tokens' embeddings; `deepstack[j]` is added to the hidden states of
those tokens after decoder layer j (Qwen3VLTextModel._deepstack_process). Both are for the decoder to use; this
module does not touch it.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear
from surojax.models.layers.params import param
from surojax.models.vision.block import VisionBlock, rotary_cos_sin
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.grid import VisionGrid
from surojax.models.vision.merger import PatchMerger


@dataclass(frozen=True)
class VisionOutput:
    merged: jax.Array                 # [N / m^2, out_hidden_size]
    deepstack: tuple[jax.Array, ...]  # one [N / m^2, out_hidden_size] per deepstack_visual_indexes entry
    last_hidden: jax.Array            # [N, hidden_size], the last block's output (before the merger)


class PatchEmbed(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size, (None, "embed"), use_bias=True, param_dtype=param_dtype,
                           rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        return self.proj(pixel_values)


class PositionTable(nnx.Module):
    """The learned side x side position embeddings (transformers' `pos_embed`, an nn.Embedding)."""

    def __init__(self, cfg: VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = param(rngs, (cfg.num_position_embeddings, cfg.hidden_size), (None, "embed"), param_dtype)

    def __call__(self, indices: jax.Array, weights: jax.Array) -> jax.Array:
        """indices, weights [N, 4] -> [N, D]: the bilinear blend of four table rows, in the table's dtype."""
        table = self.embedding[...]
        return jnp.einsum("nkd,nk->nd", table[indices], weights.astype(table.dtype))


class VisionTower(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, param_dtype=param_dtype, rngs=rngs)
        self.pos_embed = PositionTable(cfg, param_dtype=param_dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(cfg, param_dtype=param_dtype, rngs=rngs) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False, param_dtype=param_dtype, rngs=rngs)
        self.deepstack_merger_list = nnx.List([
            PatchMerger(cfg, postshuffle_norm=True, param_dtype=param_dtype, rngs=rngs)
            for _ in cfg.deepstack_visual_indexes])

    def __call__(self, pixel_values: jax.Array, grid: VisionGrid, dtype=None, cudnn: bool = False) -> VisionOutput:
        """pixel_values [N, patch_dim] for `grid` (vision_grid(grid_thw, ...)) -> VisionOutput; `dtype` the compute
        dtype (default: pixel_values'); `cudnn`: the blocks' attention through cuDNN where the dtype allows
        (block.py)."""
        cfg = self.cfg
        if pixel_values.ndim != 2 or pixel_values.shape != (grid.num_patches, cfg.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected [{grid.num_patches}, "
                             f"{cfg.patch_dim}] for grid_thw {grid.grid_thw.tolist()} (rows = sum of t*h*w, "
                             f"columns = channels x temporal_patch_size x patch_size^2)")
        x = pixel_values.astype(dtype or pixel_values.dtype)
        x = self.patch_embed(x)
        x = x + self.pos_embed(jnp.asarray(grid.interp_indices), jnp.asarray(grid.interp_weights)).astype(x.dtype)
        cos, sin = rotary_cos_sin(jnp.asarray(grid.rotary_positions), cfg)
        segment_ids, layout = jnp.asarray(grid.segment_ids), jnp.asarray(grid.attention_layout)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segment_ids, layout, cudnn)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        return VisionOutput(merged=self.merger(x), deepstack=tuple(deepstack), last_hidden=x)
