"""FLOPs of one training step, for MFU (model FLOPs utilisation) against the measured bf16 ceiling.

Model FLOPs, not hardware FLOPs: recomputation (remat) is not counted, so a policy that recomputes more
shows a lower MFU for the same work. A multiply-add is 2 FLOPs. Per step, with tokens = A * B * T:

    linear   P_lin = L * (D*N*H + 2*D*K*H + N*H*D + 3*D*F)  +  D*V        (projections + MLP + lm_head;
             the lm_head counts whether tied or not; embedding lookups, norms, rope, softmax, SiLU are free)
    attn     A_fwd = L * 4 * N * H * pairs                                (QK^T and PV: 2*H each per pair
             and head), pairs = sum over the segments of every row of the (query, key) pairs the causal
             mask keeps: l*(l+1)/2 for a segment of l tokens (sum_i min(i, W) with a sliding window W), so
             causal halving and packing are both counted exactly; one 2048-token segment gives
             pairs = 2048*2049/2 per row.
    full fine-tune   6 * P_lin * tokens  +  3 * A_fwd
             forward 2*P_lin per token; backward 4*P_lin (gradient w.r.t. activations and w.r.t. weights);
             attention backward = 2x its forward (dS from dO.V, dQ, dK, dV: four matmuls against two)
    LoRA     4 * P_lin * tokens  +  6 * P_ad * tokens  +  3 * A_fwd
             the frozen base: forward 2*P_lin and backward w.r.t. activations 2*P_lin, no weight gradients;
             adapters P_ad = L * r * sum over the targets of (d_in + d_out): forward 2*P_ad, backward 4*P_ad
             (both gradients); attention as above (its inputs need gradients in both modes).

Qwen3-0.6B shapes, LoRA r16 on the 7 targets, one 2048-token segment per row: 3.15 GFLOP per token (the
"~3.1 GFLOP/token" of shared/BENCHMARKS.md): 2.38 frozen linear, 0.06 adapters, 0.70 attention; Qwen3-8B
LoRA 32.3, Llama-3-8B LoRA 31.9. Packing 4 segments per row lowers the
attention part to about a quarter: MFU counts the work actually done, tokens/s counts every position.

Mixture of experts (`cfg.moe`): the FLOPs of the ACTIVE parameters, what each token runs through. A MoE layer's
feed-forward per token is the router D*E plus k experts of 3*D*F_e each (gate, up [D, F_e], down [F_e, D]), so

    P_lin = L * (D*N*H + 2*D*K*H + N*H*D + D*E + k*3*D*F_e)  +  D*V

with the router frozen under LoRA like every other base weight (its input still needs gradients: the routing
weights depend on it). The sort, gathers and the weighted sum of the k outputs are data movement (free).
Expert LoRA targets `gate_up_proj` [D, 2*F_e] and `down_proj` [F_e, D] add r*(d_in + d_out) per token and
per active expert: k times that per layer. Qwen3-30B-A3B (3.04B active matmul parameters of 30.5B), LoRA r16
on the attention targets, one 2048-token segment per row: 14.7 GFLOP per token (12.2 frozen linear, of which
the lm_head is 1.2; 0.08 adapters; 2.4 attention); with the expert targets too, 14.9. The "6 x active
parameters" count quoted for MoE MFU is `mode="full"` here: 6 * P_lin * tokens + 3 * A_fwd (18.2 + 2.4).

Hybrid (`cfg.linear_attention`, Qwen3.5): L_a attention layers and L_l = L - L_a Gated DeltaNet layers. An
attention layer's q_proj is twice as wide when it gives the output gate; a DeltaNet layer's projections are
in_proj_qkv [D, 2 Hk Dk + Hv Dv], in_proj_z [D, Hv Dv], in_proj_b / in_proj_a [D, Hv] and out_proj [Hv Dv, D];
the feed-forward runs on every layer. The attention term counts the L_a layers only; the DeltaNet's token mixing
is the chunk algorithm's work (pallas_kernels/gated_delta/chunked.py, chunks of C = 64), per token and value head

    G_fwd = 2 C (3 Dk + 2 Dv) + 6 Dk Dv + C^2 / 3        (K K^T, Q K^T, U, W; W S, Q S, K^T u; the inverse)

times L_l Hv tokens, and 3x that for forward + backward (as attention; the depthwise conv is free). LoRA targets
count on the layers that have them (attention targets L_a times, DeltaNet targets L_l times, MLP targets L).
Qwen3.5-0.8B shapes, LoRA r16 on all linears, one 2048-token segment per row: 3.38 GFLOP per token (3.01 frozen
linear, 0.07 adapters, 0.15 attention, 0.16 DeltaNet mixing).

LFM2 (`cfg.short_conv`): L_c = L - L_a short-conv layers, each with in_proj [D, 3D] and out_proj [D, D] (LoRA targets
conv.in_proj / conv.out_proj on those layers only); the depthwise conv of K taps and the gates are free. Per-layer
windows (`cfg.layer_windows`, Gemma 3's sliding layers): each attention layer's pairs with its own window.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from surojax.models.config import ModelConfig
from surojax.models.targets import ATTENTION_TARGETS, LINEAR_ATTENTION_TARGETS, LORA_TARGETS, SHORT_CONV_TARGETS

DELTANET_CHUNK = 64  # pallas_kernels/gated_delta/chunked.py CHUNK (bench/ does not import the kernels)
PEAK_BF16_FLOPS = 731e12  # jnp.dot 8192^3 bf16 on the H200 (shared/BENCHMARKS.md, 2026-11-29)


def linear_params(cfg: ModelConfig) -> int:
    """P_lin: matmul weights a token passes through (per layer x L, plus the lm_head); a MoE layer counts its
    router, the k active experts and a shared expert (module docstring)."""
    D = cfg.hidden_size
    attention = D * cfg.q_dim * (2 if cfg.attn_output_gate else 1) + 2 * D * cfg.kv_dim + cfg.q_dim * D
    if cfg.moe is None:
        ffn = 3 * D * cfg.intermediate_size
    else:
        ffn = D * cfg.moe.num_experts + cfg.moe.experts_per_token * 3 * D * cfg.moe.expert_intermediate_size \
            + cfg.moe.shared_expert_params(D)  # a shared expert and its gate: every token runs them
    deltanet = sum(d_in * d_out for d_in, d_out in _deltanet_dims(cfg).values())  # or a short conv's

    return (cfg.num_attention_layers * attention + _num_linear_layers(cfg) * deltanet + cfg.num_layers * ffn
            + D * cfg.vocab_size)


def _num_linear_layers(cfg: ModelConfig) -> int:
    return cfg.num_layers - cfg.num_attention_layers


def _deltanet_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of the second stack's projections: a Gated DeltaNet layer's or LFM2's short conv's; {} on a
    model with one stack."""
    la, D = cfg.linear_attention, cfg.hidden_size
    if cfg.short_conv is not None:
        return {"conv.in_proj": (D, 3 * D), "conv.out_proj": (D, D)}
    if la is None:
        return {}
    return {"in_proj_qkv": (D, la.conv_dim), "in_proj_z": (D, la.value_dim), "in_proj_b": (D, la.num_value_heads),
            "in_proj_a": (D, la.num_value_heads), "out_proj": (la.value_dim, D)}


def deltanet_mix_flops(cfg: ModelConfig, tokens: int) -> int:
    """The chunk algorithm's forward work over `tokens` positions in every DeltaNet layer (module docstring)."""
    la, C = cfg.linear_attention, DELTANET_CHUNK
    if la is None:
        return 0
    Dk, Dv = la.key_head_dim, la.value_head_dim
    per_head = 2 * C * (3 * Dk + 2 * Dv) + 6 * Dk * Dv + C * C // 3
    return _num_linear_layers(cfg) * la.num_value_heads * per_head * tokens


# MoE expert projections as LoRA targets: (d_in, d_out) of one expert, by the ExpertLinear names of
# surojax/models/layers/moe.py (gate_up_proj [E, D, 2F_e], down_proj [E, F_e, D])
EXPERT_TARGETS = ("gate_up_proj", "down_proj")


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each LoRA target one token passes through once (a dense MLP's or one expert's)."""
    D = cfg.hidden_size
    dims = {"q_proj": (D, cfg.q_dim * (2 if cfg.attn_output_gate else 1)), "k_proj": (D, cfg.kv_dim), "v_proj": (D, cfg.kv_dim), "o_proj": (cfg.q_dim, D)}
    if cfg.moe is None:
        F = cfg.intermediate_size
        dims.update(gate_proj=(D, F), up_proj=(D, F), down_proj=(F, D))
    else:
        F = cfg.moe.expert_intermediate_size
        dims.update(gate_up_proj=(D, 2 * F), down_proj=(F, D))
        F_s = cfg.moe.shared_expert_intermediate_size
        if F_s:  # the shared expert: every token runs it once
            dims.update({"shared_expert.gate_proj": (D, F_s), "shared_expert.up_proj": (D, F_s),
                         "shared_expert.down_proj": (F_s, D)})
    return {**dims, **_deltanet_dims(cfg)}


def flop_targets(cfg: ModelConfig, targets: str | Iterable[str]) -> tuple[str, ...]:
    """`lora_target_modules` as the keys of `target_dims`: "all-linear" is every target the model has; on a MoE
    model "experts" is both expert projections, "experts.X" is X and gate_proj + up_proj is the fused
    gate_up_proj (the spellings surojax.peft accepts)."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    if targets == ["all-linear"]:
        return tuple(target_dims(cfg))
    if cfg.moe is None:
        return tuple(targets)
    out = []
    for t in targets:
        t = t.removeprefix("experts.")
        names = EXPERT_TARGETS if t == "experts" else ("gate_up_proj",) if t in ("gate_proj", "up_proj") else (t,)
        out += [n for n in names if n not in out]
    return tuple(out)


def adapter_params(cfg: ModelConfig, rank: int, targets: Iterable[str] = LORA_TARGETS) -> int:
    """Adapter parameters a token passes through: per layer, r*(d_in + d_out) per target, times k for an expert
    target of a MoE model (each token runs k experts' adapters). `targets`: keys of `target_dims`."""
    dims = target_dims(cfg)
    targets = list(targets)
    unknown = [t for t in targets if t not in dims]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not linears of a {cfg.model_type} layer "
                         f"(expected some of {', '.join(dims)})")
    k = cfg.moe.experts_per_token if cfg.moe is not None else 1

    def layers(t: str) -> int:  # the layers that have target t (a hybrid's attention / DeltaNet layers)
        return cfg.num_attention_layers if t in ATTENTION_TARGETS else \
            _num_linear_layers(cfg) if t in LINEAR_ATTENTION_TARGETS + SHORT_CONV_TARGETS else cfg.num_layers
    return rank * sum(layers(t) * sum(dims[t]) * (k if cfg.moe is not None and t in EXPERT_TARGETS else 1)
                      for t in targets)


def causal_pairs(segment_lengths: Iterable[int], window: int | None = None) -> int:
    """(query, key) pairs a causal (optionally windowed) mask keeps, summed over segments."""
    total = 0
    for n in segment_lengths:
        n = int(n)
        if window is None or window >= n:
            total += n * (n + 1) // 2
        else:
            total += window * (window + 1) // 2 + (n - window) * window
    return total


def attention_pairs(cfg: ModelConfig, segment_lengths: Sequence[int]) -> int:
    """(query, key) pairs over every attention layer, each with its own window (cfg.layer_windows)."""
    if cfg.layer_windows is None:
        return cfg.num_attention_layers * causal_pairs(segment_lengths, cfg.sliding_window)
    windows = [w for w, attention in zip(cfg.layer_windows, _attention_layers(cfg)) if attention]
    return sum(causal_pairs(segment_lengths, w) * windows.count(w) for w in set(windows))


def _attention_layers(cfg: ModelConfig) -> list[bool]:
    kinds = cfg.linear_attention or cfg.short_conv
    return [True] * cfg.num_layers if kinds is None else [not k for k in kinds.layers]


def step_flops(cfg: ModelConfig, *, mode: str, tokens: int, segment_lengths: Sequence[int], rank: int = 16,
               targets: Iterable[str] = LORA_TARGETS) -> dict[str, float]:
    """FLOPs of one optimizer step over `tokens` positions whose segments have `segment_lengths` (all rows,
    all micro-batches). Returns {"total", "linear", "adapters", "attention", "linear_attention", "per_token"}."""
    if mode not in ("lora", "full"):
        raise ValueError(f"mode {mode!r}: expected lora or full")
    p_lin = linear_params(cfg)
    attn_fwd = 4 * cfg.num_heads * cfg.head_dim * attention_pairs(cfg, segment_lengths)
    if mode == "full":
        linear, adapters = 6 * p_lin * tokens, 0
    else:
        linear, adapters = 4 * p_lin * tokens, 6 * adapter_params(cfg, rank, targets) * tokens
    attention, linear_attention = 3 * attn_fwd, 3 * deltanet_mix_flops(cfg, tokens)
    total = linear + adapters + attention + linear_attention
    return {"total": float(total), "linear": float(linear), "adapters": float(adapters),
            "attention": float(attention), "linear_attention": float(linear_attention), "per_token": float(total) / max(tokens, 1)}
