"""Grouped-query self-attention over packed rows, with an optional KV cache (any `surojax.models.kv.LayerKV`).

Packing: every token carries a segment id (0 = padding) and its position inside its own segment. Query t
sees key s only when both are in the same segment and pos[s] <= pos[t] (and, with a sliding window W,
pos[t] - pos[s] < W), so a packed row computes exactly what each of its sequences computes alone.

Backends (an `AttentionBackend`, models/layers/attention_backend.py, parsed once from the config's spelling):
`xla` (einsum + masked softmax, any device; the reference) and `cudnn` (cuDNN's fused flash attention, GPU
only). `auto` picks cudnn on GPU and xla elsewhere.

The cudnn backend and packed rows (training / prefill, no KV cache): cuDNN's packed ("ragged", THD) layout
takes per row up to M segments as (offsets [B, M+1], lengths [B, M]), unused entries -1, and runs causal
attention inside each segment, so no [T, S] mask is ever built. The layout is derived inside jit from the
segment ids by `packed_segments`: every maximal run of equal segment ids is one cuDNN segment (a run of
padding, id 0, is a segment of its own, so every position gets a finite output; padding outputs are not the
xla backend's, but no real token ever reads them). M is static: `cudnn` means M = DEFAULT_MAX_SEGMENTS (16),
`cudnn:M` sets it. cuDNN's cost grows with M (it launches B*M sequence slots of T positions each; empty
slots exit early), so M should be the smallest bound the data respects.

Always correct, whatever the traced ids: one `lax.switch` per call picks
    0  every row is one run                    -> cuDNN, plain causal (no packing metadata)
    1  every row has <= M runs and the packing -> cuDNN, packed layout, causal per segment
       is what cuDNN can express
    2  anything else (more than M runs in a    -> the xla reference under jax.checkpoint (slow, exact)
       row; positions that are not 0, 1, 2 ... inside a run; a segment id that comes back after another)
The switch costs one small predicate per layer (and, without CUDA-graph conditionals, one device->host
read of the branch index per layer in the forward and backward pass). `cudnn:M:nocheck` skips it and always
takes branch 1: only for callers that guarantee the packing (at most M runs per row, positions counting up
from 0 inside each run); anything else then computes wrong attention. cuDNN handles bf16/fp16 only: other
dtypes (fp32 recipes) take the xla path statically. With a KV cache (generation) cudnn uses the dense mask.

Attention sinks (gpt_oss): a learned logit per query head [N] joins every softmax denominator and is dropped
(`softmax_with_sinks`). cuDNN's fused attention in jax has no sinks, so a layer with sinks takes the xla path
under every backend (statically); the paged Pallas decode kernel likewise never serves it (kv/paged.py gathers).

Per-layer windows (gpt_oss alternates sliding / full; `ModelConfig.layer_windows`): each window is a layer type
of the decoder's layer pattern (surojax/models/layer_runner.py), so a layer's window is a static Python int the
runner passes to its call (0 = full attention): every backend sees a constant window.

Gemma 3: the softmax scale is query_pre_attn_scalar ** -0.5 (`ModelConfig.query_pre_attn_scalar`; else H ** -0.5),
q/k norms zero-centred ((1 + w)), and the sliding layers' rope is their own: the decoder hands every layer both ropes'
cos/sin and a layer's type option `rope` picks one (Block).

Gemma 4: the softmax scale is 1 (`query_pre_attn_scalar` 1.0), q/k norms plain w, and the values RMS-normalised
without a weight (`ModelConfig.v_norm`) before they are cached.

Keys as values (Gemma 4's `attention_k_eq_v`, on its full layers: `ModelConfig.global_attention`): no v_proj; the
values are the key projection's output, v-normed, while the keys go on through the k norm and rope.

KV-shared layers (Gemma 4's last `num_kv_shared_layers`, `ModelConfig.kv_shared` on their stack's config): no k / v
projections or k norm; the call is handed the keys / values its source layer computed for the same tokens
(`shared_kv`; the source returns them with `store_kv`) and attends over them (with a cache: writes them into its own
rows first, so its rows hold its source's history: generate keeps a copy rather than reading the source's rows).

Fused decode prologue (SUROJAX_DECODE_PROLOGUE=pallas; off by default): at a decode call over the serving pool,
the split of the joined qkv, the q / k norms, rope and the k / v write into the pool run as one kernel
(models/layers/decode_prologue.py says which calls), then the attention reads the pool (`PagedLayerKV.attend_written`).

Output gate (Qwen3.5, `ModelConfig.attn_output_gate`): q_proj gives [N, 2H] per token, each head's query then its
gate; the attention output is multiplied by sigmoid(gate) before o_proj.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

from surojax.models.config import ModelConfig
from surojax.models.kv import MASKED as _MASKED
from surojax.models.kv import AttendSpec, KVMeta, LayerKV, attention_mask, softmax_with_sinks
from surojax.models.layers.attention_backend import (AUTO, DEFAULT_MAX_SEGMENTS, AttentionBackend, AttentionKind,
                                                     as_attention_backend)
from surojax.models.layers.decode_prologue import fused_decode_prologue
from surojax.models.layers.linear import Linear, fused_linear
from surojax.models.layers.norm import RMSNorm, rms_norm_unscaled
from surojax.models.layers.params import param
from surojax.models.layers.rope import apply_rope


def xla_attention(q, k, v, mask, scale: float, sinks: jax.Array | None = None) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S], sinks None or [N] -> [B, T, N, H]. Softmax in fp32."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    sinks_kg = None if sinks is None else sinks.reshape(1, K, N // K, 1, 1)  # head n = k * G + g, as q's reshape
    probs = softmax_with_sinks(scores, sinks_kg, axis=-1).astype(v.dtype)  # [B, K, G, T, S]
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return out.reshape(B, T, N, H)


def cudnn_attention(q, k, v, mask, scale: float, sinks: jax.Array | None = None) -> jax.Array:
    """Dense-mask cuDNN attention (used with a KV cache, where q and k differ in length); sinks: the xla path."""
    if q.dtype not in _CUDNN_DTYPES or sinks is not None:
        return xla_attention(q, k, v, mask, scale, sinks)
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn")


BACKENDS = {AttentionKind.XLA: xla_attention, AttentionKind.CUDNN: cudnn_attention}
# runs per row of a cache call's packed self-attention: the serving runner's rows are one sequence from position 0,
# then padding (2 runs); a row with more takes the per-layer check's xla branch (or is wrong under nocheck)
PACKED_CALL_SEGMENTS = 2

# ---- cuDNN fused attention over packed rows -----------------------------------------------------------------

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def packed_segments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """segment_ids [B, T] -> (lengths [B, M], offsets [B, M+1], runs [B]), all int32: cuDNN's packed layout.

    Each maximal run of equal ids (padding runs included) is one segment: offsets[b, j] is the first token of
    run j of row b (a token index inside the row) and lengths[b, j] its length, for j < min(runs, M); every
    other entry is -1 (no end marker: jax flattens the non-negative entries across rows, so an end marker
    misaligns every later row; benchmarks/RESULTS.md). `runs` counts the runs of each row. A row with more
    than M runs gets its runs M-1, M, ... merged into slot M-1 (wrong attention there), which is why
    `cudnn_packed_attention` never uses the layout of such a batch.
    """
    B, T = segment_ids.shape
    M = max_segments
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [B, T] run index of each token
    runs = run[:, -1] + 1  # [B]
    slot = jnp.where(starts & (run < M), run, M + 1)  # M + 1 is out of range: dropped
    rows = jnp.arange(B)[:, None]
    tok = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    starts_at = jnp.full((B, M + 1), -1, jnp.int32).at[rows, slot].set(tok, mode="drop")
    used = jnp.minimum(runs, M)[:, None]  # [B, 1]
    j = jnp.arange(M + 1, dtype=jnp.int32)[None, :]
    ends = jnp.where(j == used, T, starts_at)  # the run after the last used one starts at T
    lengths = jnp.where(j[:, :M] < used, ends[:, 1:] - ends[:, :-1], -1).astype(jnp.int32)
    # cuDNN's contract (jax.nn's packed layout): offsets of the segments only, -1 after them, NO end marker:
    # jax flattens every non-negative entry across rows, so an extra entry would shift every later row.
    offsets = jnp.where(j < used, starts_at, -1).astype(jnp.int32)
    return lengths, offsets, runs.astype(jnp.int32)


def packing_is_canonical(segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """True when run-wise causal attention equals the segment/position mask of `attention_mask`.

    That holds when, inside every run of a non-zero id, positions are 0, 1, 2, ... and no non-zero id
    appears in two runs (ids increase from run to run; padding runs of id 0 may sit anywhere).
    """
    B, T = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    tok = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    run_start = jax.lax.cummax(jnp.where(starts, tok, 0), axis=1)
    pos_ok = (segment_ids == 0) | (positions == tok - run_start)
    prev_max = jnp.concatenate([jnp.zeros((B, 1), segment_ids.dtype),
                                jax.lax.cummax(segment_ids, axis=1)[:, :-1]], axis=1)
    ids_ok = ~starts | (segment_ids == 0) | (segment_ids > prev_max)
    return jnp.all(pos_ok & ids_ok)


def _cudnn_fused(q, k, v, lengths, offsets, *, scale: float, causal_only: bool, sliding_window: int | None):
    """jax's cuDNN flash attention, BTNH layout, GQA as is. lengths/offsets None: plain causal rows."""
    if causal_only:
        return dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL, qkv_layout="BTNH",
                                     sliding_window_length=sliding_window)
    return dot_product_attention(q, k, v, None, None, lengths, lengths, offsets, offsets, scale=scale,
                                 mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
                                 sliding_window_length=sliding_window)


def cudnn_packed_attention(q, k, v, segment_ids, positions, scale: float, *, sliding_window: int | None = None,
                           max_segments: int = DEFAULT_MAX_SEGMENTS, check: bool = True,
                           fused=None) -> jax.Array:
    """q [B, T, N, H], k/v [B, T, K, H], segment_ids/positions [B, T] -> [B, T, N, H] (self-attention).

    `fused` replaces the cuDNN call (same signature as `_cudnn_fused`); tests pass a jnp emulation.
    """
    fused = fused or _cudnn_fused
    if q.dtype not in _CUDNN_DTYPES:
        return xla_attention(q, k, v, attention_mask(segment_ids, segment_ids, positions, positions,
                                                     sliding_window), scale)
    lengths, offsets, runs = packed_segments(segment_ids, max_segments)

    def dense(q, k, v):
        return fused(q, k, v, None, None, scale=scale, causal_only=True, sliding_window=sliding_window)

    def packed(q, k, v):
        return fused(q, k, v, lengths, offsets, scale=scale, causal_only=False, sliding_window=sliding_window)

    if not check:
        return packed(q, k, v)

    @jax.checkpoint
    def reference(q, k, v):
        mask = attention_mask(segment_ids, segment_ids, positions, positions, sliding_window)
        return xla_attention(q, k, v, mask, scale)

    branch = cudnn_branch(segment_ids, positions, max_segments, runs)
    return jax.lax.switch(branch, (dense, packed, reference), q, k, v)


def cudnn_branch(segment_ids, positions, max_segments: int, runs=None) -> jax.Array:
    """The branch `cudnn_packed_attention` takes: 0 plain causal cuDNN, 1 packed cuDNN, 2 xla reference."""
    if runs is None:
        runs = packed_segments(segment_ids, max_segments)[2]
    canonical = packing_is_canonical(segment_ids, positions)
    return jnp.where(canonical & jnp.all(runs == 1), 0,
                     jnp.where(canonical & jnp.all(runs <= max_segments), 1, 2)).astype(jnp.int32)


def runs_per_row(segment_ids) -> int:
    """Host-side: the most runs of equal ids in any row of segment_ids [..., T] (numpy), as `packed_segments`
    counts them (a padding run is a run)."""
    ids = np.asarray(segment_ids).reshape(-1, np.shape(segment_ids)[-1])
    return int(((ids[:, 1:] != ids[:, :-1]).sum(axis=1) + 1).max()) if ids.size else 1


def packed_backend(backend: AttentionBackend, max_runs: int | None) -> AttentionBackend:
    """The backend for training on packed rows whose layout the data pipeline built (positions counting up from
    0 inside each sample, no id coming back) with at most `max_runs` runs per row: auto on a GPU becomes
    `cudnn:M:nocheck`, M = max(2, max_runs): cuDNN's cost grows with M (B * M sequence slots), and the
    per-layer check's switch is not needed for rows built that way (the measurements: benchmarks/RESULTS.md).
    Anything else: unchanged."""
    if backend.kind is not AttentionKind.AUTO or max_runs is None or jax.default_backend() != "gpu":
        return backend
    return AttentionBackend(AttentionKind.CUDNN, max(2, int(max_runs)), check=False)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, backend: AttentionBackend | str = AUTO, param_dtype,
                 rngs: nnx.Rngs | None = None):
        D, H = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, H
        # the softmax scale: H ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
        self.scale = float(cfg.query_pre_attn_scalar or H) ** -0.5
        self.sliding_window = cfg.sliding_window
        self.per_layer_windows = cfg.layer_windows is not None  # each call then passes its layer type's window
        self.backend = as_attention_backend(backend).resolved(jax.default_backend())  # static: xla, or cudnn with its M and check
        bias = cfg.attention_bias
        self.output_gate = cfg.attn_output_gate
        q_out = cfg.q_dim * (2 if cfg.attn_output_gate else 1)  # [N, 2H]: query | gate per head
        self.q_proj = Linear(D, q_out, ("embed", "heads"), use_bias=bias, param_dtype=param_dtype, rngs=rngs)
        # Gemma 4's KV-shared layers (`cfg.kv_shared`) have no k / v projections: they are handed another layer's
        self.kv_shared = cfg.kv_shared
        self.k_proj = None if cfg.kv_shared else Linear(D, cfg.kv_dim, ("embed", "kv_heads"), use_bias=bias,
                                                        param_dtype=param_dtype, rngs=rngs)
        # Gemma 4's attention_k_eq_v (its full layers): no v_proj, the values are the key projection's output
        self.v_proj = None if cfg.attention_k_eq_v or cfg.kv_shared else Linear(
            D, cfg.kv_dim, ("embed", "kv_heads"), use_bias=bias, param_dtype=param_dtype, rngs=rngs)
        self.o_proj = Linear(cfg.q_dim, D, ("heads", "embed"), use_bias=cfg.o_proj_bias, param_dtype=param_dtype,
                             rngs=rngs)
        self.qkv_proj: Linear | None = nnx.data(None)  # q, k, v in one GEMM (fused_projections: serving)
        if cfg.qk_norm:
            zc = cfg.norm_zero_centered
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype, rngs=rngs, zero_centered=zc)
            self.k_norm = None if cfg.kv_shared else RMSNorm(H, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype,
                                                             rngs=rngs, zero_centered=zc)
        else:
            self.q_norm = self.k_norm = None
        self.v_norm_eps = cfg.rms_norm_eps if cfg.v_norm else None  # Gemma 4: values RMS-normalised, no weight
        # [N] sink logits (HF `self_attn.sinks`), one per query head; head n reads kv head n // G
        self.sinks = param(rngs, (cfg.num_heads,), ("heads",), param_dtype) if cfg.attention_sinks else None

    def __call__(self, x, cos, sin, segment_ids, positions, kv: LayerKV | None = None,
                 kv_meta: KVMeta | None = None, window: int | None = None, *, norm=None,
                 residual: jax.Array | None = None, shared_kv: tuple | None = None, store_kv: bool = False):
        """x [B, T, D]; cos/sin [B, T, H]; segment_ids/positions [B, T] -> (y [B, T, D], kv).

        norm (the block's RMSNorm): x is the un-normalised stream, normalised here; residual: y = residual + the
        attention's output. At decode a weight laid out for the decode GEMV runs them in the joined qkv
        projection's prologue and o_proj's epilogue (linear.fused_linear); elsewhere they are the same ops.

        Without a cache (kv None): self-attention over the packed rows. With one: `kv` is this layer's view of
        the cache (any `LayerKV`) and `kv_meta` the call's metadata its cache made (`Cache.step`); the view
        writes the new tokens' k/v and attends over the rows' context, and comes back updated.
        shared_kv: a KV-shared layer's (Gemma 4) keys / values [B, T, K, H] of this call's tokens, as its source
        layer made them (normed, rotated); written to its cache and attended like its own. store_kv: also return
        this layer's (k, v) (the source of KV-shared layers): -> (y, kv, (k, v)).
        `window`: this layer's static window (0 = full; its type's option in the decoder's layer pattern);
        required exactly when the config has per-layer windows.
        """
        if (window is None) == self.per_layer_windows:
            raise ValueError("per-layer attention windows: pass this layer's window (its layer type's option, "
                             "surojax.models.decoder.layer_pattern) exactly when cfg.layer_windows is set")
        B, T, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        Q = N * H * (2 if self.output_gate else 1)
        qkv = None if norm is None or self.qkv_proj is None else fused_linear(self.qkv_proj, x, norm=norm)
        if qkv is None and norm is not None:
            x = norm(x)
        if self.qkv_proj is not None:  # [B, T, (N + 2K) H]: one read of x, one GEMM (decode: one GEMV launch)
            qkv = self.qkv_proj(x) if qkv is None else qkv
            # a decode over the serving pool: split, q / k norms, rope and the k / v write as one kernel (or None)
            fused = None if store_kv else fused_decode_prologue(self, qkv, cos, sin, kv, kv_meta)
            if fused is not None:
                q, kv = fused
                out, kv = kv.attend_written(q, kv_meta, self.attend_spec(window))
                return self._output(out, None, residual), kv
            q, k, v = jnp.split(qkv, [Q, Q + K * H], axis=-1)
        elif self.kv_shared:
            if shared_kv is None:
                raise ValueError("a KV-shared attention layer needs its source layer's keys / values (shared_kv)")
            q, k, v = self.q_proj(x), None, None
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            v = k if self.v_proj is None else self.v_proj(x)  # k = v: the projection before the k norm and rope
        gate = None
        if self.output_gate:  # [B, T, N, 2H] -> query, gate [B, T, N, H]
            q, gate = jnp.split(q.reshape(B, T, N, 2 * H), 2, axis=-1)
        q = q.reshape(B, T, N, H)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        if k is None:  # a KV-shared layer: its source's keys / values, already normed and rotated
            k, v = shared_kv
        else:
            k, v = k.reshape(B, T, K, H), v.reshape(B, T, K, H)
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.v_norm_eps is not None:
                v = rms_norm_unscaled(v, self.v_norm_eps)
            k = apply_rope(k, cos, sin)
        own = (k, v)
        spec = self.attend_spec(window)
        if kv is not None:
            out, kv = kv.update_and_attend(q, k, v, kv_meta, spec)
        elif self.backend.kind is AttentionKind.CUDNN and self.sinks is None:
            out = self._cudnn_self_attention(q, k, v, segment_ids, positions, spec.sliding_window)
        else:
            mask = attention_mask(segment_ids, segment_ids, positions, positions, spec.sliding_window)
            out = xla_attention(q, k, v, mask, spec.scale, spec.sinks)  # [B, T, N, H]
        y = self._output(out, gate, residual)
        return (y, kv, own) if store_kv else (y, kv)

    def _output(self, out, gate, residual):
        """The attention's output [B, T, N, H] -> o_proj (gated by sigmoid(gate) [B, T, N, H] when given), plus
        residual when given -> [B, T, D]."""
        B, T, N, H = out.shape
        out = out.reshape(B, T, N * H)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.reshape(B, T, N * H))
        y = None if residual is None else fused_linear(self.o_proj, out, residual=residual)
        if y is None:
            y = self.o_proj(out)
            y = y if residual is None else residual + y
        return y

    def _cudnn_self_attention(self, q, k, v, segment_ids, positions, sliding_window: int | None):
        """cuDNN over packed rows, with this layer's static window."""
        m, check = self.backend.segments, self.backend.check
        return cudnn_packed_attention(q, k, v, segment_ids, positions, self.scale,
                                      sliding_window=sliding_window, max_segments=m, check=check)

    def attend_spec(self, window: int | None = None) -> AttendSpec:
        """The dense attention over a cache's context: this layer's backend (cuDNN with a dense mask, or xla),
        scale, static window (the config's, or this layer's `window`, 0 = full) and sinks; with cuDNN and no
        sinks also its packed causal kernel (`AttendSpec.packed`: a cache's call without context, e.g. the
        serving pool's fresh prefill, `kv.paged`), bounded to PACKED_CALL_SEGMENTS runs per row."""
        sinks = None if self.sinks is None else self.sinks[...]
        w = self.sliding_window if window is None else (window or None)
        packed = None
        if self.backend.kind is AttentionKind.CUDNN and sinks is None:
            packed = functools.partial(cudnn_packed_attention, scale=self.scale, sliding_window=w,
                                       max_segments=PACKED_CALL_SEGMENTS, check=self.backend.check)
        return AttendSpec(BACKENDS[self.backend.kind], self.scale, w, sinks, packed)
