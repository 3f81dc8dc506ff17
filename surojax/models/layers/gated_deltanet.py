"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid layers, over packed rows.

    x [B, T, D] -> in_proj_qkv -> depthwise causal conv1d (K taps) + SiLU -> q, k [B, T, Hk, Dk], v [B, T, Hv, Dv]
                   in_proj_z -> z [B, T, Hv, Dv]      in_proj_b -> beta = sigmoid(b) [B, T, Hv]
                   in_proj_a -> g = -exp(A_log) * softplus(a + dt_bias) [B, T, Hv]   (log-decay, <= 0, fp32)
    q, k L2-normalised, each key head repeated for its Hv / Hk value heads; the gated delta rule
    (pallas_kernels.gated_delta: per head a state S [Dk, Dv], decayed by exp(g), written by the delta rule,
    read by q scaled by Dk^-0.5) -> o [B, T, Hv, Dv] -> RMSNormGated(o, z) -> out_proj -> [B, T, D]

Packed rows: the conv and the recurrent state both start fresh where the segment id changes (a packed row computes
what each of its sequences computes alone; padding, id 0, is a segment of its own whose outputs no real token
reads). transformers zeroes padded inputs instead (`apply_mask_to_padding_states`): for a left-padded row that is
the same as a fresh start. Parameters: in_proj_* and out_proj `Linear`s ([in, out]), the conv kernel as
transformers stores it [C, 1, K] (C = 2 Hk Dk + Hv Dv channels: q | k | v), dt_bias / A_log [Hv], the gated norm's
scale [Dv]. The linear attention's own dims carry no logical axis name (replicated under every sharding rule; only
`embed` and the layers axis are split). With a cache view (generation: kv/recurrent.py), the conv and the rule continue the row's states.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.layers.deltanet_cache import deltanet_mix
from surojax.models.layers.linear import Linear
from surojax.models.layers.norm import gated_rms_norm
from surojax.models.layers.params import AXES, param

def _a_log_init(rngs: nnx.Rngs | None, n: int, dtype) -> nnx.Param:
    """A_log = log(A), A ~ U(0.01, 16) per value head (transformers' init; kept away from log 0)."""
    if rngs is None:
        value = jnp.zeros((n,), dtype)
    else:
        value = jnp.log(jax.random.uniform(rngs.params(), (n,), jnp.float32, 0.01, 16.0)).astype(dtype)
    return nnx.Param(value, **{AXES: (None,)})


class GatedNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.scale = param(rngs, (dim,), ("head_dim",), param_dtype, init="ones")  # [Dv]

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return gated_rms_norm(x, gate, self.scale[...], self.eps)


class Conv1d(nnx.Module):
    def __init__(self, channels: int, taps: int, *, param_dtype, rngs: nnx.Rngs | None = None):
        bound = 1.0 / np.sqrt(taps)  # torch's Conv1d default (kaiming-uniform, a = sqrt(5), fan_in = K)
        value = jnp.zeros((channels, 1, taps), param_dtype) if rngs is None else jax.random.uniform(
            rngs.params(), (channels, 1, taps), jnp.float32, -bound, bound).astype(param_dtype)
        self.kernel = nnx.Param(value, **{AXES: (None, None, None)})  # [C, 1, K]


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs | None = None):
        la = cfg.linear_attention
        D, Hv = cfg.hidden_size, la.num_value_heads
        self.shape = la  # the head layout deltanet_mix reads (a frozen config: static)
        self.num_key_heads, self.num_value_heads = la.num_key_heads, Hv
        self.key_head_dim, self.value_head_dim = la.key_head_dim, la.value_head_dim
        self.in_proj_qkv = Linear(D, la.conv_dim, ("embed", None), param_dtype=param_dtype, rngs=rngs)
        self.in_proj_z = Linear(D, la.value_dim, ("embed", None), param_dtype=param_dtype, rngs=rngs)
        self.in_proj_b = Linear(D, Hv, ("embed", None), param_dtype=param_dtype, rngs=rngs)
        self.in_proj_a = Linear(D, Hv, ("embed", None), param_dtype=param_dtype, rngs=rngs)
        # the four in one GEMM (surojax.models.fused_projections: serving); the parts are None then
        self.in_proj_qkvzba: Linear | None = nnx.data(None)
        self.conv1d = Conv1d(la.conv_dim, la.conv_kernel, param_dtype=param_dtype, rngs=rngs)
        self.dt_bias = param(rngs, (Hv,), (None,), param_dtype, init="ones")
        self.A_log = _a_log_init(rngs, Hv, param_dtype)
        self.norm = GatedNorm(la.value_head_dim, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.out_proj = Linear(la.value_dim, D, (None, "embed"), param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array, state=None):
        """x [B, T, D], segment_ids [B, T], state: this layer's cache view or None -> ([B, T, D], the new view or
        None). The conv, q / k normalisation and the delta rule: layers/deltanet_cache.py `deltanet_mix`."""
        B, T, _ = x.shape
        Hv, Dv = self.num_value_heads, self.value_head_dim
        if self.in_proj_qkvzba is not None:  # one read of x, one GEMM (decode: one GEMV launch)
            conv_dim = self.shape.conv_dim
            qkv, z, b, a = jnp.split(self.in_proj_qkvzba(x), [conv_dim, conv_dim + Hv * Dv, conv_dim + Hv * Dv + Hv],
                                     axis=-1)
        else:
            qkv, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        z = z.reshape(B, T, Hv, Dv)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [B, T, Hv]
        a = a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)  # [B, T, Hv], <= 0
        o, state = deltanet_mix(qkv, g, beta, segment_ids, conv_weight=self.conv1d.kernel[...],
                                shape=self.shape, state=state)  # [B, T, Hv, Dv]
        return self.out_proj(self.norm(o, z).reshape(B, T, Hv * Dv)), state
