"""The patch merger (transformers' Qwen3VLVisionPatchMerger): merge_size**2 consecutive patches (one merge block,
the processor's order) -> one language-model token of out_hidden_size.

norm -> view [N / m^2, m^2 D] -> fc1 (m^2 D -> m^2 D) -> exact (erf) GELU -> fc2 (-> out_hidden_size). The final
merger normalises each patch over D before the view; the deepstack mergers (`postshuffle_norm`) normalise the
joined m^2 D vector after it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.layer_norm import LayerNorm


class PatchMerger(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, postshuffle_norm: bool, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.joined = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNorm(self.joined if postshuffle_norm else cfg.hidden_size, cfg.layer_norm_eps,
                              (None,) if postshuffle_norm else ("embed",), param_dtype=param_dtype)
        self.linear_fc1 = Linear(self.joined, self.joined, (None, "mlp"), use_bias=True, param_dtype=param_dtype,
                                 rngs=rngs)
        self.linear_fc2 = Linear(self.joined, cfg.out_hidden_size, ("mlp", "embed"), use_bias=True,
                                 param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, D] -> [N / merge_size**2, out_hidden_size]."""
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.joined))
        else:
            x = self.norm(x).reshape(-1, self.joined)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))
