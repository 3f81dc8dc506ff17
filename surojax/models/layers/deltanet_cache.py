"""Gated DeltaNet's token mixing (causal conv1d -> L2-normalised q / k -> gated delta rule), with or without a
cache: the one function a Gated DeltaNet layer calls between its input projections and its gated norm.

    o, view = deltanet_mix(mixed_qkv, g, beta, segment_ids, conv_weight=, shape=, conv_bias=, state=kv)

mixed_qkv [B, T, C] is the layer's `in_proj_qkv` output BEFORE the conv (q, k, v concatenated: C =
`shape.conv_dim`); g [B, T, H] the log decay (fp32, <= 0: -exp(A_log) * softplus(a + dt_bias)); beta [B, T, H]
(sigmoid(b)); H = value heads. conv_weight [C, 1, K] (transformers' `conv1d.weight`), conv_bias [C] or None;
shape: the head layout (`StateShape`, or the config's `LinearAttentionConfig`: the same fields). -> o [B, T, H, Dv] (mixed_qkv's dtype), which the layer feeds to its gated RMSNorm and out_proj.

Inside: the depthwise causal conv1d over time (kernel K) and SiLU; split into q, k [.., Hk, Dk] and v
[.., H, Dv]; q and k L2-normalised (eps 1e-6, as transformers / fla); q / k heads repeated to the value heads
(head h reads key head h // (H / Hk), `repeat_interleave`); the gated delta rule with scale Dk ** -0.5
(pallas_kernels/gated_delta).

Without a cache (`state` None: training, evaluation): packed rows; the conv window and the delta rule's state
both reset where the segment id changes (a token never sees another segment's inputs). Returns (o, None).

With a cache (`state` = the layer's `LayerState` / `StackedLayerState` view, kv/recurrent.py): each row is ONE
sequence that continues the view's state; its real tokens (segment id > 0) come first, padding (id 0) after them
(right padding, as generation lays out prompts). The conv reads the row's last K - 1 earlier inputs from the
conv state; the delta rule starts from the row's recurrent state, through the chunk rule (prefill, T > 1) or
the one-token recurrent step (decode, T = 1); padding leaves the state unchanged (g = 0 and beta = 0 there) and
the new conv state is the row's last K - 1 REAL inputs. Returns (o, the view with the new states written).
Prefill then decode equals the uncached computation over the whole sequence (tests/models/test_deltanet_cache.py).

A `TokenStatesView` (speculative verification, serve/state_slots.py: each row keeps the state after its last
ACCEPTED token, known only after the call) gets the call's inputs to the state instead of a new one: the conv
inputs [B, T, C] and `DeltaInputs` (k, v, g, beta), from which `TokenStateCache.at_tokens` replays the state to
any token; the outputs come from the one-token recurrent step run T times (the decode step's arithmetic).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.api import chunk_gated_delta_rule, recurrent_gated_delta_step
from surojax.kernel_settings import kernel_settings
from surojax.models.kv.recurrent import DeltaInputs, StateShape

L2_EPS = 1e-6  # transformers' / fla's l2norm: x / sqrt(sum x^2 + eps)


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, computed in fp32, in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def segment_runs(segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, T] int32: the index of each token's run of equal segment ids within its row."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = jnp.zeros((segment_ids.shape[0], 1), bool)
    return jnp.cumsum(jnp.concatenate([first, change], axis=1), axis=1, dtype=jnp.int32)


def causal_conv1d(x, weight, bias=None, *, segment_ids=None, prefix=None, silu: bool = True) -> jax.Array:
    """SiLU(depthwise causal conv1d) of x [B, T, C] with weight [C, 1, K] (bias [C] or None) -> [B, T, C] in x's
    dtype (accumulated in fp32). Output t = sum_j weight[:, 0, j] * input[t - (K - 1) + j]. silu False: the conv
    alone (LFM2's short convolution, layers/short_conv.py).

    prefix [B, K - 1, C]: the inputs before x (a cached sequence's last K - 1; None: zeros, the sequence starts
    here). segment_ids [B, T] or None: a tap reads only inputs of the output token's run of equal segment ids
    (the prefix counts as the first token's run)."""
    B, T, C = x.shape
    K = weight.shape[-1]
    if prefix is None:
        prefix = jnp.zeros((B, K - 1, C), x.dtype)
    xin = jnp.concatenate([prefix.astype(x.dtype), x], axis=1).astype(jnp.float32)  # [B, K - 1 + T, C]
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    out = jnp.zeros((B, T, C), jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32), (B, T, C))
    if segment_ids is not None:
        runs = segment_runs(segment_ids)
        runs_in = jnp.concatenate([jnp.zeros((B, K - 1), jnp.int32), runs], axis=1)
    for j in range(K):  # tap j reads input t - (K - 1) + j = xin[t + j]
        tap = xin[:, j:j + T] * w[:, j]
        if segment_ids is not None and j < K - 1:
            tap = jnp.where((runs_in[:, j:j + T] == runs)[..., None], tap, 0.0)
        out = out + tap
    return (jax.nn.silu(out) if silu else out).astype(x.dtype)


def last_real_inputs(prefix, x, segment_ids) -> jax.Array:
    """The conv state after a call: each row's last K - 1 real inputs of [prefix; x] ([B, K - 1, C]), the real
    tokens (segment id > 0) being the first of the row's T (right padding)."""
    Km1 = prefix.shape[1]
    xin = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
    n = jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32)  # [B]
    idx = n[:, None] + jnp.arange(Km1, dtype=jnp.int32)[None, :]  # [B, K - 1]
    return jnp.take_along_axis(xin, idx[:, :, None], axis=1)


def _per_token_rule(q, k, v, g, beta, recurrent, scale):
    """The delta rule one token at a time (the decode step's `recurrent_gated_delta_step`, T times) from the row's
    state -> o [B, T, H, Dv]: a short call (speculative verification, T = K + 1 <= ~9) whose rows each continue
    with the state after a token chosen later; same values as T decode steps."""
    def step(state, xs):
        o, state = recurrent_gated_delta_step(*xs, state, scale=scale)
        return state, o

    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta))  # time first
    _, o = jax.lax.scan(step, recurrent, xs)
    return jnp.swapaxes(o, 0, 1)


def _check(mixed_qkv, g, beta, segment_ids, conv_weight, shape: StateShape) -> None:
    B, T, C = mixed_qkv.shape
    want = {"mixed_qkv": ((B, T, shape.conv_dim), mixed_qkv.shape), "g": ((B, T, shape.num_value_heads), g.shape),
            "beta": ((B, T, shape.num_value_heads), beta.shape), "segment_ids": ((B, T), segment_ids.shape),
            "conv_weight": ((shape.conv_dim, 1, shape.conv_kernel), conv_weight.shape)}
    for name, (expected, got) in want.items():
        if tuple(got) != expected:
            raise ValueError(f"deltanet_mix: {name} has shape {tuple(got)}, expected {expected} for {shape}")


def deltanet_mix(mixed_qkv, g, beta, segment_ids, *, conv_weight, shape: StateShape, conv_bias=None, state=None,
                 impl: str | None = None):
    """Gated DeltaNet's mixing, uncached (`state` None) or from the layer's cache view: the module docstring.
    `impl`: the chunk rule's implementation (None: the process's kernel setting, SUROJAX_GATED_DELTA).
    -> (o [B, T, H, Dv] in mixed_qkv's dtype, the new view or None)."""
    _check(mixed_qkv, g, beta, segment_ids, conv_weight, shape)
    impl = kernel_settings().gated_delta.value if impl is None else impl
    backward = kernel_settings().gated_delta_bwd.value
    B, T, _ = mixed_qkv.shape
    Hk, Dk, H, Dv = shape.num_key_heads, shape.key_head_dim, shape.num_value_heads, shape.value_head_dim
    prefix, recurrent = (None, None) if state is None else state.read()
    x = causal_conv1d(mixed_qkv, conv_weight, conv_bias, segment_ids=segment_ids, prefix=prefix)
    q, k, v = jnp.split(x, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    q, k = (jnp.repeat(l2_normalize(a.reshape(B, T, Hk, Dk)), H // Hk, axis=2) for a in (q, k))  # [B, T, H, Dk]
    v = v.reshape(B, T, H, Dv)
    scale = Dk ** -0.5
    g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
    if state is None:
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, impl=impl,
                                      backward=backward)
        return o, None
    real = (segment_ids > 0)[..., None]  # padding: no decay, no write (the state passes unchanged)
    g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
    if state.per_token:  # the inputs to the state, replayed to a later-chosen token (kv/recurrent.py)
        o = _per_token_rule(q, k, v, g, beta, recurrent, scale)
        return o, state.written(mixed_qkv, DeltaInputs(k, v, g, beta))
    if T == 1:
        o, recurrent = recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent,
                                                  scale=scale)
        o = o[:, None]
    else:
        o, recurrent = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=recurrent,
                                              output_final_state=True, impl=impl)
    return o, state.written(last_real_inputs(prefix, mixed_qkv, segment_ids), recurrent)


__all__ = ["L2_EPS", "causal_conv1d", "deltanet_mix", "l2_normalize", "last_real_inputs", "segment_runs"]
