"""LFM2's short convolution: the token mixer of its `conv` layers (transformers' `Lfm2ShortConv`), over packed rows.

    x [B, T, D] -> in_proj -> b | c | v (each [B, T, D])
                   y = c * conv(b * v)          conv: depthwise causal conv1d of K = conv_L_cache taps, no activation
                   -> out_proj -> [B, T, D]

`in_proj` [D, 3D], `out_proj` [D, D] and the conv (kernel [D, 1, K] as transformers stores it, bias [D]) carry
biases only with `conv_bias`. The conv is layers/deltanet_cache.py's `causal_conv1d` without its SiLU: on packed
rows a tap reads only inputs of its own segment (the conv starts fresh where the segment id changes: a packed row
computes what each of its sequences computes alone; padding, id 0, is a segment of its own whose outputs no real
token reads).

With a cache view (generation, serving: kv/recurrent.py, a `StateCache` over the `conv_layers` stack whose
`recurrent` part is None), each row is ONE sequence that continues the view's conv state: the last K - 1 conv
INPUTS (b * v) before this call. Its real tokens come first, right padding after them; the new state is the row's
last K - 1 real inputs (`last_real_inputs`), so padding leaves it unchanged. Prefill then decode equals the
uncached computation over the whole sequence (tests/models/test_lfm2.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.config import ShortConvConfig
from surojax.models.layers.deltanet_cache import causal_conv1d, last_real_inputs
from surojax.models.layers.linear import Linear
from surojax.models.layers.params import AXES, param


class DepthwiseConv(nnx.Module):
    """The conv's parameters: kernel [C, 1, K] (torch's Conv1d layout), bias [C] or None."""

    def __init__(self, channels: int, taps: int, *, use_bias: bool, param_dtype, rngs: nnx.Rngs | None = None):
        bound = 1.0 / np.sqrt(taps)  # torch's Conv1d default (kaiming-uniform, a = sqrt(5), fan_in = K)
        value = jnp.zeros((channels, 1, taps), param_dtype) if rngs is None else jax.random.uniform(
            rngs.params(), (channels, 1, taps), jnp.float32, -bound, bound).astype(param_dtype)
        self.kernel = nnx.Param(value, **{AXES: (None, None, None)})  # [C, 1, K]
        self.bias = param(rngs, (channels,), (None,), param_dtype, init="zeros") if use_bias else None


class ShortConv(nnx.Module):
    def __init__(self, hidden: int, sc: ShortConvConfig, *, param_dtype, rngs: nnx.Rngs | None = None):
        self.in_proj = Linear(hidden, 3 * hidden, ("embed", None), use_bias=sc.bias, param_dtype=param_dtype,
                              rngs=rngs)
        self.conv = DepthwiseConv(hidden, sc.kernel, use_bias=sc.bias, param_dtype=param_dtype, rngs=rngs)
        self.out_proj = Linear(hidden, hidden, (None, "embed"), use_bias=sc.bias, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array, state=None):
        """x [B, T, D], segment_ids [B, T], state: this layer's cache view or None -> ([B, T, D], the new view or
        None)."""
        b, c, v = jnp.split(self.in_proj(x), 3, axis=-1)  # [B, T, D] each
        bv = b * v
        bias = None if self.conv.bias is None else self.conv.bias[...]
        prefix = None if state is None else state.read()[0]  # [B, K - 1, D]: the conv inputs before this call
        y = c * causal_conv1d(bv, self.conv.kernel[...], bias, segment_ids=segment_ids, prefix=prefix, silu=False)
        if state is not None:
            # per_token (`TokenStatesView`): the conv inputs, from which the window after a later-chosen token is cut
            state = state.written(bv if state.per_token else last_real_inputs(prefix, bv, segment_ids), None)
        return self.out_proj(y), state


__all__ = ["DepthwiseConv", "ShortConv"]
