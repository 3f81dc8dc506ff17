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
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from surojax.models.config import ModelConfig
from surojax.models.targets import LORA_TARGETS

PEAK_BF16_FLOPS = 731e12  # jnp.dot 8192^3 bf16 on the H200 (shared/BENCHMARKS.md, 2026-11-29)


def linear_params(cfg: ModelConfig) -> int:
    """P_lin: matmul weights a token passes through (per layer x L, plus the lm_head); a MoE layer counts its
    router, the k active experts and a shared expert (module docstring)."""
    D = cfg.hidden_size
    attention = D * cfg.q_dim + 2 * D * cfg.kv_dim + cfg.q_dim * D
    if cfg.moe is None:
        ffn = 3 * D * cfg.intermediate_size
    else:
        ffn = D * cfg.moe.num_experts + cfg.moe.experts_per_token * 3 * D * cfg.moe.expert_intermediate_size \
            + cfg.moe.shared_expert_params(D)  # a shared expert and its gate: every token runs them
    return cfg.num_layers * (attention + ffn) + D * cfg.vocab_size


# MoE expert projections as LoRA targets: (d_in, d_out) of one expert, by the ExpertLinear names of
# surojax/models/layers/moe.py (gate_up_proj [E, D, 2F_e], down_proj [E, F_e, D])
EXPERT_TARGETS = ("gate_up_proj", "down_proj")


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each LoRA target one token passes through once (a dense MLP's or one expert's)."""
    D = cfg.hidden_size
    dims = {"q_proj": (D, cfg.q_dim), "k_proj": (D, cfg.kv_dim), "v_proj": (D, cfg.kv_dim), "o_proj": (cfg.q_dim, D)}
    if cfg.moe is None:
        F = cfg.intermediate_size
        dims.update(gate_proj=(D, F), up_proj=(D, F), down_proj=(F, D))
    else:
        F = cfg.moe.expert_intermediate_size
        dims.update(gate_up_proj=(D, 2 * F), down_proj=(F, D))
    return dims


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
    per_layer = sum(sum(dims[t]) * (k if cfg.moe is not None and t in EXPERT_TARGETS else 1) for t in targets)
    return cfg.num_layers * rank * per_layer


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


def step_flops(cfg: ModelConfig, *, mode: str, tokens: int, segment_lengths: Sequence[int], rank: int = 16,
               targets: Iterable[str] = LORA_TARGETS) -> dict[str, float]:
    """FLOPs of one optimizer step over `tokens` positions whose segments have `segment_lengths` (all rows,
    all micro-batches). Returns {"total", "linear", "adapters", "attention", "per_token"}."""
    if mode not in ("lora", "full"):
        raise ValueError(f"mode {mode!r}: expected lora or full")
    p_lin = linear_params(cfg)
    attn_fwd = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * causal_pairs(segment_lengths, cfg.sliding_window)
    if mode == "full":
        linear, adapters = 6 * p_lin * tokens, 0
    else:
        linear, adapters = 4 * p_lin * tokens, 6 * adapter_params(cfg, rank, targets) * tokens
    attention = 3 * attn_fwd
    total = linear + adapters + attention
    return {"total": float(total), "linear": float(linear), "adapters": float(adapters),
            "attention": float(attention), "per_token": float(total) / max(tokens, 1)}
