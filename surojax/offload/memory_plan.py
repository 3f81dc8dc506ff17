"""Memory plan before training: an estimate of peak device memory by component, checked against capacity.

`plan_memory(model_cfg, ...)` returns a `MemoryPlan` whose components are bytes ON ONE DEVICE (no sharding but
the ZeRO stage's divisors of weights, gradients and optimizer state, `*_shards`):

    weights      frozen base (LoRA: compute dtype, bf16; a quantised base, qlora's or a pre-quantised checkpoint's: the
                 layers' Linear kernels at `kernel_weight_bytes` per value; experts kept packed, gpt-oss's MXFP4: their
                 kernels at `expert_weight_bytes` per value) or master weights (full: `master_dtype`, fp32 in the bf16
                 recipe); with `offload_base` the device copy of one layer plus the norms and the head stay on the
                 device (an untied embedding is streamed too: it is on the device only for the forward's token gather;
                 XLA does not prefetch the next layer, measured; `prefetch`: the layer computing plus `prefetch_depth`
                 layers fetched ahead, the bound prefetch.py's unrolled loop enforces); with `offload_master` the layers
                 are their compute-dtype copy (c bytes / param; their fp32 master is in host memory) plus two layers'
                 master in flight during the per-layer update, the embedding / head / norms stay in `master_dtype`
    cast_weights full fine-tune with master != compute dtype: the compute-dtype copies of the weights; fp8_hybrid
                 (current / delayed scaling) adds the step's E4M3 copies of the kernels it swaps (2 bytes per value:
                 `fp8_cache_values`).
                 recompute none / dots keep every layer's cast copy as a residual of the scan; full keeps one
                 layer; plus the head's cast copy used by the loss (with `offload_master` the head's only: the
                 layers are stored in the compute dtype, so bf16 recipe: 2 bytes / layer param instead of 4 + 2)
    adapters     LoRA A and B of every target of every layer (`lora_dtype`, fp32)
    gradients    the fp32 accumulation buffer of the trainable params (`make_train_step`'s g_acc) plus the
                 micro-batch's gradient in the trainable dtype (the compute dtype for layers under
                 `offload_master`), both live at the accumulate. Full fine-tuning with `offload_optimizer` /
                 `offload_master` updates in place, one layer at a time (offload/optimizer.py `in_place`): the
                 accumulator only when `accum` > 1 (one micro-batch's gradients are used as they are), plus one
                 fp32 copy of the params outside the layers (their whole-tree update: embedding, head);
                 checked against XLA's compiled buffer assignment (surojax/bench/step_memory.py, Qwen3-8B at 4
                 and 8 layers scaled to 36: tests/offload/test_in_place_update.py). Full fine-tuning with
                 `optimizer_layerwise` (`layerwise_update` here) runs the same in-place update with everything
                 on the device: the same gradient figure. The whole-tree update adds its temporaries
                 (`_UPDATE_TEMP_BYTES`: adamw_8bit's fp32 moments of every tensor at once)
    host         (not a device component, not in the total) pinned host memory this plan puts there: the
                 layers' fp32 master (`offload_master`) and optimizer state (`offload_optimizer`)
    optimizer    AdamW: 2 fp32 moments per trainable param (adamw_8bit: 2 bytes, normuon: 4); with
                 `offload_optimizer` two layers' state (updated per layer, surojax/offload/optimizer.py) plus
                 the state of the params outside the layers (embedding, head, final norm), which stays
    activations  residuals saved by the scanned layers for the backward (below), for B x T tokens
    logits       one chunk of the chunked CE: fp32 logits [C, V], fp32 softmax / d-logits [C, V] and the
                 d-logits cast to the compute dtype [C, V] (C = `lm_chunk_tokens`, capped at B x T)
    workspace    backward temporaries of one layer (the recomputed layer under `full`, its gradients
                 otherwise), 10% of the saved activations for residuals not modelled one by one (RMS inverse
                 scales, softmax statistics, rope tables, masks, allocator fragmentation), and 0.5 GiB fixed
                 (cuDNN / cuBLAS workspaces, the batch, the embedding gather); quantised kernels add one layer's
                 of them dequantised to the compute dtype (the reference path's operands: x @ dequantize(),
                 the grouped GEMM's experts)

Activations, bytes saved per token per layer (c = compute-dtype bytes, D, F, NH = N*H, KH = K*H):

    none   everything autodiff keeps: the two RMSNorms (fp32 input D*4 + normed D*c each), q/k/v projection
           outputs (NH + 2 KH)*c, qk-norm (qwen3: fp32 input + output, (NH + KH)*(4 + c)), rope outputs
           (NH + KH)*c, the attention output NH*c, o_proj output and residual 2 D*c, MLP gate, up, silu(gate)
           and their product 4 F*c, down output and residual 2 D*c, and the LoRA x@A of each target R*c
    dots   the layer input D*c plus the outputs of the weight matmuls (no batch dims): q/k/v (NH + 2 KH)*c,
           o_proj D*c, gate/up 2 F*c, down D*c, LoRA x@A and (x@A)@B of each target (R + out)*c
           (a first build that returned matmuls in fp32 measured dots above none; since the backward
           GEMMs run in the compute dtype the matmul outputs are c bytes)
    none, unrolled (`unroll` covers every layer: no scan) the residuals XLA cannot fuse away: what dots keeps
           plus the attention output NH*c. Inside a scan every residual autodiff names is written into an
           [L, ...] stack; with the layers inlined, the elementwise ones (norms, rope, silu, the LoRA sums) are
           fused into their backward consumers and recomputed there, and the matmul and attention outputs stay
           (a model of the measured drop, calibrated in tests/offload/test_memory_plan.py). Partial unrolling
           (an int below L) keeps the scan and is planned as rolled; dots / full / offload save what their
           policy names either way (unrolled full is not a candidate of `layer_loop_choice`; unmeasured alone)
    full   the layer input only, D*c (the layer is recomputed in the backward: counted in workspace)
    offload  nothing on the device: the layer inputs of `full` are kept in host memory (the workspace still
           holds one recomputed layer)

Hybrid models (Qwen3.5: cfg.linear_attention): the terms above are the attention layers' (cfg.num_attention_layers;
a gated attention's q_proj is 2 NH wide: the query and its output gate, NH*c more under dots, 2 NH*c under none),
and each Gated DeltaNet layer saves, with P = conv_dim + value_dim + 2 Hv its input projections' outputs
(in_proj_qkv | z | b | a), Hv value heads, Dk / Dv their head dims and N = ceil(T / 64) chunks per row:

    none   the norms and MLP as an attention layer, P*c, the causal conv's fp32 sum and SiLU output
           conv_dim*(4 + c), the q / k L2-norm 2 key_dim*(4 + c), g and beta 2 Hv*4, the rule's output and the gated
           norm's fp32 input and output value_dim*(4 + 2c), out_proj output and residual 2 D*c, the LoRA x@A of its
           targets; plus the chunk rule's residuals per row and head (`deltanet_chunk_bytes`, per layer, not
           per token), by the implementation that runs: the chunked jnp form (a CPU's) keeps in fp32 the state
           entering each chunk N*Dk*Dv, the state recurrence's m N*Dk*Dk and r N*Dk*Dv, the per-chunk [64, 64]
           matrices (UT inverse, decay, attn and their intermediates) 11 N*64*64 and the chunked operands
           N*64*(5 Dk + 2 Dv) (counts from XLA's buffer assignment, CPU, rolled scan); pallas_v2 (a GPU's) only
           the chunk states and v_new in the compute dtype, N*(Dk*Dv + 64 Dv)*c
    dots   the layer input D*c, the input projections P*c, out_proj D*c, the MLP's and the LoRA's as above (the
           chunk rule's matmuls all have batch dims: recomputed)
    none, unrolled  what dots keeps plus the rule's output value_dim*c and the chunk rule's residuals
    full / offload  as an attention layer
The workspace's recomputed layer is the larger of the two kinds. LoRA adapters: the attention targets on the
attention layers, the DeltaNet's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) on the DeltaNet layers,
the MLP's on all.

Short-conv layers (LFM2: cfg.short_conv; `conv_layer_bytes`, the second stack's term like the DeltaNet's): per
token, besides the norms and MLP of an attention layer, in_proj's output b | c | v 3 D*c, b * v D*c, the conv's
output D*(4 + c), the gated product c * conv D*c and out_proj's output and residual 2 D*c under none (the LoRA x@A
of its targets R*c); under dots the layer input D*c, in_proj 3 D*c, out_proj D*c, the MLP's and the LoRA's as
above; none unrolled = dots + the gated product; full / offload as an attention layer. LoRA targets conv.in_proj
[D, 3D] and conv.out_proj [D, D] count on the conv layers only.

MoE layers (cfg.moe): the weights count every expert (ModelConfig.num_params); in the MLP terms above F is one
expert's and its rows are per assignment, k per token ([A, 2F] with A = tokens * k), plus the router's fp32
logits (dots; none also its softmax) [E] per token and, under none, the gathered input and expert output rows
k * 2 D*c; LoRA on the experts' projections has one adapter per expert (E x the dense count) and k rows per token.

Calibration (benchmarks/RESULTS.md, H200, bf16, seq 2048, lm chunk 4,096): see tests/offload/test_memory_plan.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.api import resolve_impl
from pallas_kernels.gated_delta.chunked import CHUNK
from surojax.kernel_settings import kernel_settings
from surojax.models.layer_runner import Recompute
from surojax.models.registry import FAMILIES
from surojax.models.targets import CONV_SPELLINGS
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.counts import tower_activation_bytes, tower_lora_params, tower_params
from surojax.offload.prefetch import PREFETCH_DEPTH
from surojax.precision.recipe import Recipe
from surojax.precision.linear_swap import KEPT_BF16

GiB = 1024 ** 3
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_OPT_BYTES = {"adamw": 8, "adamw_8bit": 2, "normuon": 4}
# the whole-tree update's temporaries beyond the fp32 gradients, per trainable parameter: adamw_8bit dequantises
# every moment to fp32 and quantises the new ones at once (XLA's buffer figures of the compiled full fine-tuning
# step between 2 and 4 layers: 23.1 bytes per layer parameter against adamw's 8.0 = accumulator + gradients;
# without this term Qwen3-8B full fine-tuning ran out of memory on a GPU the plan said it fit: benchmarks/RESULTS.md).
# The in-place per-layer update (optimizer_layerwise, offload_*) holds one layer's.
_UPDATE_TEMP_BYTES = {"adamw_8bit": 15}
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_DELTANET_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # a hybrid's DeltaNet layers
_CONV_TARGETS = ("conv.in_proj", "conv.out_proj")  # LFM2's short-convolution layers (models/targets.py)
_FIXED_WORKSPACE = GiB // 2
_UNMODELLED = 0.10
COMPONENTS = ("weights", "cast_weights", "adapters", "gradients", "optimizer", "activations", "logits", "workspace")


class MemoryPlanError(ValueError):
    """The run's estimated peak device memory exceeds the device's capacity."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    weights: int
    cast_weights: int
    adapters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    workspace: int
    host: int = 0  # bytes in pinned host memory (offload_master / offload_optimizer); not part of `total`
    settings: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    model_cfg: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in COMPONENTS)

    def fits(self, capacity_bytes: int | None) -> bool:
        return capacity_bytes is None or self.total <= capacity_bytes

    def components(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in COMPONENTS}

    def with_settings(self, **changes) -> "MemoryPlan":
        """The plan of the same model with some settings changed (keys of `plan_memory`)."""
        return plan_memory(self.model_cfg, **{**self.settings, **changes})


def _layer_shapes(cfg):
    """D, F, NH, KH and each target's (in, out). A MoE layer: F is one expert's (its activations are per
    assignment, k per token: `_moe_rows`)."""
    F = cfg.intermediate_size if cfg.moe is None else cfg.moe.expert_intermediate_size
    D, NH, KH = cfg.hidden_size, cfg.q_dim, cfg.kv_dim
    gated = NH * 2 if cfg.attn_output_gate else NH  # a gated attention's q_proj: the query and its output gate
    io = {"q_proj": (D, gated), "k_proj": (D, KH), "v_proj": (D, KH), "o_proj": (NH, D),
          "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
    return D, F, NH, KH, io


def _moe_rows(cfg) -> tuple[int, int]:
    """(k, E): a MoE layer runs k expert rows per token ([A, 2F] with A = tokens * k) and a router over E
    experts; a dense layer (1, 0): one MLP row per token, no router."""
    return (1, 0) if cfg.moe is None else (cfg.moe.experts_per_token, cfg.moe.num_experts)


def _per_expert(cfg, target: str) -> int:
    """Copies of a target's LoRA per layer: E for the experts' projections of a MoE layer (A [E, in, R]), else 1."""
    return cfg.moe.num_experts if cfg.moe is not None and target in ("gate_proj", "up_proj", "down_proj") else 1


def _kernel_bytes(cfg, target: str, kernel_bytes: float | None, expert_bytes: float | None) -> float | None:
    """Bytes per value of a target's frozen kernel when it stays quantised (plan_memory's kernel_weight_bytes /
    expert_weight_bytes), None: the base dtype."""
    if expert_bytes is not None and _per_expert(cfg, target) > 1:
        return expert_bytes
    return kernel_bytes


def _targets(targets, cfg=None) -> tuple[str, ...]:
    """The planned LoRA targets: the seven dense names, a hybrid's DeltaNet projections and LFM2's conv
    projections ("all-linear": all of them; a DeltaNet or conv name counts only on the layers that have it). On
    LFM2 (`cfg.short_conv`) its HF spellings (in_proj, out_proj, w1 / w3 / w2) name our targets."""
    names = _TARGETS + _DELTANET_TARGETS + _CONV_TARGETS
    if targets is None or targets == "all-linear" or list(targets) == ["all-linear"]:
        return names
    targets = list(targets)
    if getattr(cfg, "short_conv", None) is not None:
        targets = [n for t in targets for n in CONV_SPELLINGS.get(t, (t,))]  # LFM2's HF module names
    return tuple(t for t in names if t in targets)


def _deltanet_io(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of a DeltaNet layer's projections and its MLP's (the same MLP as an attention layer's)."""
    la, D = cfg.linear_attention, cfg.hidden_size
    _, _, _, _, io = _layer_shapes(cfg)
    return {"in_proj_qkv": (D, la.conv_dim), "in_proj_z": (D, la.value_dim), "in_proj_b": (D, la.num_value_heads),
            "in_proj_a": (D, la.num_value_heads), "out_proj": (la.value_dim, D),
            **{t: io[t] for t in _MLP_TARGETS}}


def _conv_io(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of an LFM2 short-conv layer's projections and its MLP's (the same MLP as an attention layer's)."""
    D = cfg.hidden_size
    _, _, _, _, io = _layer_shapes(cfg)
    return {"conv.in_proj": (D, 3 * D), "conv.out_proj": (D, D), **{t: io[t] for t in _MLP_TARGETS}}


def _mixer_io(cfg) -> tuple[dict[str, tuple[int, int]], tuple[str, ...]]:
    """The second stack's layer (a hybrid's Gated DeltaNet or LFM2's short conv): its projections' (in, out) and
    the mixer's own target names."""
    if cfg.short_conv is not None:
        return _conv_io(cfg), _CONV_TARGETS
    return _deltanet_io(cfg), _DELTANET_TARGETS


def fp8_cache_values(cfg) -> int:
    """Kernel values fp8_hybrid's per-step weight cache quantises (each held as q and q^T, 1 byte apiece): the
    kernels the recipe swaps (precision/linear_swap.py), over every layer of each stack: q / k / v / o, the dense
    MLP or a shared expert's three, a hybrid DeltaNet layer's in_proj_qkv / in_proj_z / out_proj; not in_proj_b /
    in_proj_a or the routed experts (`KEPT_BF16`). Layers kept in bf16 are counted too (their kernels are cached)."""
    _, _, _, _, io = _layer_shapes(cfg)
    size = {t: i * o for t, (i, o) in io.items()}
    attention = sum(v for t, v in size.items() if t not in _MLP_TARGETS)
    mlp = sum(size[t] for t in _MLP_TARGETS) if cfg.moe is None else 3 * cfg.hidden_size * \
        cfg.moe.shared_expert_intermediate_size
    La, Ld = _layer_counts(cfg)
    deltanet = 0 if Ld == 0 else sum(i * o for t, (i, o) in _mixer_io(cfg)[0].items()
                                     if t not in _MLP_TARGETS and t not in KEPT_BF16)
    return La * (attention + mlp) + Ld * (mlp + deltanet)


def _layer_counts(cfg) -> tuple[int, int]:
    """(attention layers, the other stack's layers): a hybrid's Gated DeltaNet layers or LFM2's short-conv layers;
    every other model (L, 0)."""
    La = cfg.num_attention_layers
    return La, cfg.num_layers - La


# The chunk rule's fp32 residuals per (row, head, chunk of 64), counted in XLA's buffer assignment (CPU compile of
# the rolled layer scan's gradient, the slope per layer at Dk = Dv = 32, 64, 128: 11 x 64^2 + 7 x 64 D + 3 D^2
# values, +- 0.3%): [64, 64] matrices (the UT inverse and its 16 x 16 blocks' merges, A, the decay, attn, masks'
# products), token-wide [64, Dk] operands (q, k, W, the state reads and writes) and [64, Dv] ones (v, U), and
# the [Dk, Dv] / [Dk, Dk] states (the state entering each chunk, m, r).
_CHUNK_SQUARES, _CHUNK_KEY_ROWS, _CHUNK_VALUE_ROWS = 11, 5, 2


def deltanet_chunk_bytes(cfg, *, batch: int, seq: int, c: int = 2, impl: str | None = None) -> int:
    """Bytes one Gated DeltaNet layer's chunk rule keeps for its backward over `batch` rows of `seq` tokens,
    N = ceil(seq / 64) chunks per row and value head (Hv), for the implementation that runs (`impl`: None = the
    process's kernel setting SUROJAX_GATED_DELTA resolved on this backend, pallas_kernels.gated_delta.api):
      chunked / reference  fp32, per chunk and head the state entering it [Dk, Dv], the state recurrence's
                 m [Dk, Dk] and r [Dk, Dv], the per-chunk [64, 64] matrices (the UT inverse, decay, attn and their
                 intermediates: `_CHUNK_SQUARES`) and the chunked fp32 operands [64, Dk] / [64, Dv] (q, k, W / v, U:
                 `_CHUNK_KEY_ROWS`, `_CHUNK_VALUE_ROWS`) (XLA's buffer assignment, CPU, rolled scan)
      pallas_v2  its custom_vjp's residuals beyond the layer's own tensors: the state entering each chunk
                 [Dk, Dv] and v_new [64, Dv] per chunk and head in the compute dtype (c bytes), the fp32 initial
                 state per row and head, and q / k repeated to the Hv value heads when Hv > Hk
      pallas     the same with the chunk states in fp32 and no v_new."""
    la = cfg.linear_attention
    Dk, Dv, Hv = la.key_head_dim, la.value_head_dim, la.num_value_heads
    impl = resolve_impl(kernel_settings().gated_delta.value if impl is None else impl)
    chunks = batch * Hv * math.ceil(seq / CHUNK)
    if impl in ("pallas_v2", "pallas"):
        repeated = batch * seq * 2 * Hv * Dk * c if Hv > la.num_key_heads else 0
        states = chunks * Dk * Dv * c + chunks * CHUNK * Dv * c if impl == "pallas_v2" else chunks * Dk * Dv * 4
        return states + repeated + batch * Hv * Dk * Dv * 4
    states = Dk * Dv + Dk * Dk + Dk * Dv
    rows = CHUNK * (_CHUNK_KEY_ROWS * Dk + _CHUNK_VALUE_ROWS * Dv)
    return chunks * 4 * (states + _CHUNK_SQUARES * CHUNK * CHUNK + rows)


def deltanet_layer_bytes(cfg, recompute: Recompute, *, batch: int, seq: int, c: int = 2, rank: int = 0,
                         targets: Iterable[str] = (), unrolled: bool = False) -> int:
    """Bytes one Gated DeltaNet layer of a hybrid saves for the backward over `batch` x `seq` tokens (the
    module docstring's `DeltaNet layers`); LFM2's second stack: `conv_layer_bytes`; 0 on a model with neither."""
    la = cfg.linear_attention
    if la is None:
        return conv_layer_bytes(cfg, recompute, batch=batch, seq=seq, c=c, rank=rank, targets=targets,
                                unrolled=unrolled)
    tokens = batch * seq
    D, F = cfg.hidden_size, (cfg.intermediate_size if cfg.moe is None else cfg.moe.expert_intermediate_size)
    k, E = _moe_rows(cfg)
    io = _deltanet_io(cfg)
    targets = tuple(t for t in _targets(targets) if t in io) if rank else ()
    rows = {t: (k if t in _MLP_TARGETS else 1) for t in targets}
    proj = la.conv_dim + la.value_dim + 2 * la.num_value_heads  # in_proj_qkv | z | b | a outputs
    if recompute is Recompute.FULL:
        return tokens * D * c
    if recompute is Recompute.OFFLOAD:
        return 0
    dots = D * c + proj * c + D * c + k * (2 * F * c + D * c) + 4 * E \
        + sum(rows[t] * (rank + io[t][1]) * c for t in targets)
    if recompute is Recompute.DOTS:
        return tokens * dots
    if recompute is not Recompute.NONE:
        raise ValueError(f"recompute {recompute!r} is not a Recompute")
    chunk = deltanet_chunk_bytes(cfg, batch=batch, seq=seq, c=c)
    if unrolled:
        return tokens * (dots + la.value_dim * c) + chunk
    moe = (8 * E + k * 2 * D * c) if E else 0
    Hv = la.num_value_heads
    per_token = (2 * (D * 4 + D * c) + proj * c + la.conv_dim * (4 + c) + 2 * la.key_dim * (4 + c) + 2 * Hv * 4
                 + la.value_dim * c + la.value_dim * (4 + c) + 2 * D * c + k * 4 * F * c + moe + 2 * D * c
                 + sum(rows[t] * rank * c for t in targets))
    return tokens * per_token + chunk


def conv_layer_bytes(cfg, recompute: Recompute, *, batch: int, seq: int, c: int = 2, rank: int = 0,
                     targets: Iterable[str] = (), unrolled: bool = False) -> int:
    """Bytes one LFM2 short-conv layer saves for the backward over `batch` x `seq` tokens (the module docstring's
    `Short-conv layers`); 0 on a model without them."""
    if cfg.short_conv is None:
        return 0
    tokens, D, F = batch * seq, cfg.hidden_size, cfg.intermediate_size
    io = _conv_io(cfg)
    targets = tuple(t for t in _targets(targets, cfg) if t in io) if rank else ()
    if recompute is Recompute.FULL:
        return tokens * D * c
    if recompute is Recompute.OFFLOAD:
        return 0
    lora_dots = sum((rank + io[t][1]) * c for t in targets)
    dots = D * c + 3 * D * c + D * c + 2 * F * c + D * c + lora_dots
    if recompute is Recompute.DOTS:
        return tokens * dots
    if recompute is not Recompute.NONE:
        raise ValueError(f"recompute {recompute!r} is not a Recompute")
    if unrolled:
        return tokens * (dots + D * c)
    # norms, in_proj's b | c | v, b * v, the conv (fp32 sum, cast), c * conv, out_proj + residual, the MLP, LoRA
    return tokens * (2 * (D * 4 + D * c) + 3 * D * c + D * c + D * (4 + c) + D * c + 2 * D * c + 4 * F * c
                     + 2 * D * c + sum(rank * c for _ in targets))


def activation_bytes_per_token_layer(cfg, recompute: Recompute, *, c: int = 2, rank: int = 0,
                                     targets: Iterable[str] = (), unrolled: bool = False) -> int:
    """Bytes one layer saves for the backward per token, by recompute policy and layer loop (see the module
    docstring; `unrolled`: every layer inlined, no scan)."""
    D, F, NH, KH, io = _layer_shapes(cfg)
    k, E = _moe_rows(cfg)
    targets = tuple(t for t in _targets(targets, cfg) if t in io) if rank else ()
    rows = {t: (k if t in ("gate_proj", "up_proj", "down_proj") else 1) for t in targets}  # LoRA rows per token
    gate = NH * c if cfg.attn_output_gate else 0  # the output gate: q_proj's second half, the gated output
    if recompute is Recompute.NONE and unrolled:
        return activation_bytes_per_token_layer(cfg, Recompute.DOTS, c=c, rank=rank, targets=targets) + NH * c
    if recompute is Recompute.FULL:
        return D * c
    if recompute is Recompute.DOTS:
        # MoE: the router's fp32 logits [E] and the k grouped-GEMM rows (gate_up [2F], down [D]) per token
        lora = sum(rows[t] * (rank + io[t][1]) * c for t in targets)
        return D * c + (NH + 2 * KH) * c + gate + D * c + k * (2 * F * c + D * c) + 4 * E + lora
    if recompute is Recompute.OFFLOAD:
        return 0  # the layer inputs (full's residuals) are kept in host memory
    if recompute is Recompute.NONE:
        qk = (NH + KH) * (4 + c) if cfg.qk_norm else 0
        # MoE: router logits and softmax [E] fp32, and per assignment (k per token) the gathered input row D,
        # gate / up / silu(gate) / product 4F and the expert output D before the weighted sum
        moe = (8 * E + k * 2 * D * c) if E else 0
        return (2 * (D * 4 + D * c) + (NH + 2 * KH) * c + 2 * gate + qk + (NH + KH) * c + NH * c
                + 2 * D * c + k * 4 * F * c + moe + 2 * D * c + sum(rows[t] * rank * c for t in targets))
    raise ValueError(f"recompute {recompute!r} is not a Recompute")


def plan_memory(model_cfg, *, mode: str = "lora", recipe: Recipe | str = Recipe.BF16, rank: int = 16, targets=None,
                batch: int, seq: int, recompute: Recompute = Recompute.FULL, lm_chunk_tokens: int = 4096,
                optimizer: str = "adamw", offload_base: bool = False, offload_optimizer: bool = False,
                offload_master: bool = False, master_dtype: str = "fp32", lora_dtype: str = "fp32",
                prefetch: bool = False, prefetch_depth: int = PREFETCH_DEPTH, accum: int = 1,
                unroll: int | bool = 1, weight_shards: int = 1, gradient_shards: int = 1,
                optimizer_shards: int = 1, layerwise_update: bool = False,
                fp8_weight_cache: bool = False, expert_weight_bytes: float | None = None,
                kernel_weight_bytes: float | None = None, vision_patches: int = 0,
                vision_frame_patches: int = 0, train_vision: bool = False) -> MemoryPlan:
    """Peak device memory of one training step, by component (bytes; see the module docstring).

    unroll: the layer loop's `unroll_layers` (True or an int >= the layer count: every layer inlined).
    *_shards: the ZeRO stage's divisors (surojax/parallel/zero.py `plan_divisors`): the weights (and adapters)
    and the trainable-dtype gradients / weight_shards, the fp32 gradient accumulator / gradient_shards, the
    optimizer state / optimizer_shards. Runs with any offload_* key keep their one-device figures (their
    host-resident state is not sharded). layerwise_update (full fine-tuning): the step updates the layers in place,
    one at a time, on the device (build_optimizer's `layerwise_update`; ZeRO stage 0 only). recipe: a `Recipe`
    (or its config string); fp32 counts 4 bytes per compute value, every other 2. fp8_weight_cache (the FP8
    transform's `memory`: fp8_hybrid full fine-tuning with current or delayed scaling): the step holds its E4M3
    copies of the layers' kernels (both layouts: 2 bytes per kernel parameter, fp8_transform.Fp8WeightCaching)
    under cast_weights.
    expert_weight_bytes (LoRA on a MoE model): bytes per value of the frozen experts' kernels when they stay packed
    (MXFP4: 17 / 32), None: the compute dtype like the rest of the base. kernel_weight_bytes (LoRA): bytes per value
    of every Linear kernel of the layers (attention, MLP, experts) when the frozen base keeps them quantised (qlora,
    a pre-quantised checkpoint: `QuantFormat.bytes_per_value`); expert_weight_bytes, when given, for the experts.
    A vision-language model (config.json's vision_config): its tower's weights (frozen: in the compute dtype, no
    gradients or optimizer state; `train_vision`: as the full fine-tune's weights, or with LoRA frozen with adapters
    on its Linears: vision/counts.tower_lora_params) and the activations of
    `vision_patches` patches a micro-batch in frames of at most `vision_frame_patches` (0: unknown, one frame of
    them all; models/vision/counts.py) join the weights / gradients / optimizer / activations; `ModelConfig.num_params()` (the text model's) leaves the tower out."""
    if mode not in ("lora", "full"):
        raise ValueError(f"mode {mode!r}: expected lora or full")
    settings = dict(mode=mode, recipe=recipe, rank=rank, targets=targets, batch=batch, seq=seq, recompute=recompute,
                    lm_chunk_tokens=lm_chunk_tokens, optimizer=optimizer, offload_base=offload_base,
                    offload_optimizer=offload_optimizer, offload_master=offload_master, master_dtype=master_dtype,
                    lora_dtype=lora_dtype, prefetch=prefetch, prefetch_depth=prefetch_depth, accum=accum,
                    unroll=unroll, weight_shards=weight_shards, gradient_shards=gradient_shards,
                    optimizer_shards=optimizer_shards, layerwise_update=layerwise_update, fp8_weight_cache=fp8_weight_cache,
                    expert_weight_bytes=expert_weight_bytes, kernel_weight_bytes=kernel_weight_bytes,
                    vision_patches=vision_patches, vision_frame_patches=vision_frame_patches,
                    train_vision=train_vision)
    cfg = model_cfg
    recipe = Recipe(recipe)
    fp32 = recipe is Recipe.FP32
    c = jnp.dtype(recipe.compute_dtype).itemsize
    D, F, NH, KH, io = _layer_shapes(cfg)
    L, V = cfg.num_layers, cfg.vocab_size
    total_params = cfg.num_params()
    embed_params = V * D * (1 if cfg.tie_word_embeddings else 2) + D
    layer_params = (total_params - embed_params) // L
    lora = mode == "lora"
    tgts = _targets(targets, cfg) if lora else ()
    r = rank if lora else 0

    # weights
    if lora:
        wb = c  # the frozen base in the compute dtype
        # quantised kernels (qlora / pre-quantised: all of them; packed MXFP4: the experts' E * 3 * D * F): their
        # values per layer at their bytes each instead of wb
        kernel_bytes = {t: b for t in io if (b := _kernel_bytes(cfg, t, kernel_weight_bytes, expert_weight_bytes))
                        is not None}
        quantized = {t: _per_expert(cfg, t) * io[t][0] * io[t][1] for t in kernel_bytes}
        layer_bytes = layer_params * wb - sum(v * (wb - kernel_bytes[t]) for t, v in quantized.items())
        # streamed: the device copy of the layer being computed; an untied embedding table is in host memory too
        # (fetched for the gather at the start of the forward pass, dead before the backward pass where the peak
        # is): streamed peak = resident peak - host bytes (as the GPU runs measured it: benchmarks/RESULTS.md).
        head_params = embed_params if cfg.tie_word_embeddings else V * D + D
        weights = (head_params * wb + layer_bytes) if offload_base else embed_params * wb + L * layer_bytes
        if offload_base and prefetch:  # offload_prefetch: the copies of the next `prefetch_depth` layers in flight
            weights += prefetch_depth * layer_bytes
        # attention targets on the attention layers, a hybrid's DeltaNet targets on its DeltaNet layers, the MLP's
        # on every layer
        La, Ld = _layer_counts(cfg)
        stacks = [(La, io, _ATTENTION_TARGETS), (L, io, _MLP_TARGETS)]
        if Ld:
            stacks.append((Ld, *_mixer_io(cfg)))
        trainable = sum(n * sum(_per_expert(cfg, t) * r * (shapes[t][0] + shapes[t][1])
                                for t in tgts if t in names) for n, shapes, names in stacks)
        tb = 4 if fp32 else _DTYPE_BYTES[lora_dtype]
        adapters = trainable * tb
        cast = 0
        grad_bytes = trainable * tb
    else:
        wb = 4 if fp32 else _DTYPE_BYTES[master_dtype]
        trainable, tb, adapters = total_params, wb, 0
        cast = 0
        if offload_master:  # layers: their compute copy on the device, the master on host (two layers in flight)
            weights = embed_params * wb + L * layer_params * c + 2 * layer_params * wb
            grad_bytes = embed_params * wb + L * layer_params * c
            if wb != c:
                cast = V * D * c
        else:
            weights = (embed_params + L * layer_params) * wb
            grad_bytes = trainable * tb
            if wb != c:
                kept_layers = 1 if recompute is Recompute.FULL else L
                cast = (kept_layers * layer_params + V * D) * c
        if fp8_weight_cache:  # the step's FP8 weight cache: q, q^T
            cast += fp8_cache_values(cfg) * 2
    if not lora and (offload_optimizer or offload_master or layerwise_update):  # the in-place per-layer update
        gradients = (trainable * 4 if accum > 1 else 0) + grad_bytes + embed_params * 4
    else:
        gradients = trainable * 4 + grad_bytes + trainable * _UPDATE_TEMP_BYTES.get(optimizer, 0)
    opt_b = _OPT_BYTES.get(optimizer, 8)
    host = L * layer_params * 4 if (offload_master and not lora) else 0
    if offload_optimizer:  # two layers' state in flight; the embedding / head / final norm state stays
        opt_params = 2 * layer_params + embed_params if not lora else 2 * trainable // max(L, 1)
        optimizer_bytes = opt_params * opt_b
        host += (L * layer_params if not lora else trainable) * opt_b
    else:
        optimizer_bytes = trainable * opt_b
    if not (offload_base or offload_optimizer or offload_master):  # the ZeRO stage's split (module docstring)
        accumulator = trainable * 4
        weights, adapters = weights / weight_shards, adapters / weight_shards
        gradients = accumulator / gradient_shards + (gradients - accumulator) / weight_shards
        optimizer_bytes = optimizer_bytes / optimizer_shards
    tokens = batch * seq
    unrolled = unroll is True or (not isinstance(unroll, bool) and unroll >= L)
    per_tl = activation_bytes_per_token_layer(cfg, recompute, c=c, rank=r, targets=tgts, unrolled=unrolled)
    La, Ld = _layer_counts(cfg)  # a hybrid: its attention layers' and its Gated DeltaNet layers' terms
    lora_terms = dict(c=c, rank=r, targets=tgts)
    activations = tokens * La * per_tl + Ld * deltanet_layer_bytes(cfg, recompute, batch=batch, seq=seq,
                                                                    unrolled=unrolled, **lora_terms)
    C = min(lm_chunk_tokens, tokens)
    logits = C * V * (4 + 4 + c)
    one_layer = max(tokens * activation_bytes_per_token_layer(cfg, Recompute.NONE, **lora_terms),
                    deltanet_layer_bytes(cfg, Recompute.NONE, batch=batch, seq=seq, **lora_terms))
    workspace = one_layer + int(_UNMODELLED * activations) + _FIXED_WORKSPACE
    if lora:  # quantised kernels: the reference path dequantises one layer's at a time
        workspace += sum(quantized.values()) * c
    vision = vision_config_of(cfg)
    if vision is not None:  # the tower (models/vision/counts.py): frozen in the compute dtype, or trained like the LM
        n = tower_params(vision)
        trains = train_vision and not lora
        if trains:
            vb = 4 if fp32 else _DTYPE_BYTES[master_dtype]
            weights += n * vb
            cast += n * c if vb != c else 0
            gradients += n * (4 + vb)
            optimizer_bytes += n * _OPT_BYTES.get(optimizer, 8)
        else:
            weights += n * c
        if train_vision and lora:  # its adapters train with the language model's; the gradients flow through it
            t = tower_lora_params(vision, r)
            adapters += t * tb
            gradients += t * (4 + tb)
            optimizer_bytes += t * opt_b
        activations += tower_activation_bytes(vision, vision_patches, c=c, trains=train_vision,
                                              frame_patches=vision_frame_patches)
    return MemoryPlan(weights=int(weights), cast_weights=int(cast), adapters=int(adapters), gradients=int(gradients),
                      optimizer=int(optimizer_bytes), activations=int(activations), logits=int(logits),
                      workspace=int(workspace), host=int(host), settings=settings, model_cfg=model_cfg)


def vision_config_of(cfg) -> VisionConfig | None:
    """The tower's config of a vision-language model (config.json's vision_config), None for a text model."""
    extra = getattr(cfg, "hf_extra", None) or {}
    family = FAMILIES.get(cfg.model_type)
    if "vision_config" not in extra or family is None or not family.vision:  # Gemma's towers are not loaded
        return None
    return VisionConfig.from_hf(extra["vision_config"], cfg.model_type)


def format_plan(plan: MemoryPlan, capacity: int | None = None) -> str:
    """A table of the components in GiB, the total, and the capacity when known."""
    rows = [(k, v) for k, v in plan.components().items() if v]
    width = max(len(k) for k in list(COMPONENTS) + ["capacity"])
    lines = [f"{'component':<{width}}  {'GiB':>8}"]
    lines += [f"{k:<{width}}  {v / GiB:8.2f}" for k, v in rows]
    lines.append(f"{'total':<{width}}  {plan.total / GiB:8.2f}")
    if capacity is not None:
        verdict = "fits" if plan.fits(capacity) else "does NOT fit"
        lines.append(f"{'capacity':<{width}}  {capacity / GiB:8.2f}  ({verdict})")
    if plan.settings.get("prefetch"):
        lines.append("(offload_prefetch: a lower bound; the unrolled prefetching loop keeps more activations than "
                     "modelled here, see benchmarks/RESULTS.md)")
    return "\n".join(lines)


def fitting_options(plan: MemoryPlan, capacity: int, *, offload_available: Iterable[str] = (),
                    lmhead_chunks: int | None = None) -> list[tuple[str, int]]:
    """Single changes of the config that bring the estimate under `capacity`: (description, estimated total)."""
    s = plan.settings
    out: list[tuple[str, int]] = []

    def consider(desc, **changes):
        p = plan.with_settings(**changes)
        if p.fits(capacity):
            out.append((desc, p.total))

    if s["recompute"] is not Recompute.FULL:
        consider("recompute: full", recompute=Recompute.FULL)
        if s["recompute"] is Recompute.NONE:
            consider("recompute: dots", recompute=Recompute.DOTS)
    b = s["batch"]
    while b > 1:
        b = max(1, b // 2)
        p = plan.with_settings(batch=b)
        if p.fits(capacity):
            k = math.ceil(s["batch"] / b)
            out.append((f"per_device_train_batch_size: {b} with gradient_accumulation_steps multiplied by {k} "
                        "(same global batch)", p.total))
            break
    tokens = s["batch"] * s["seq"]
    if min(s["lm_chunk_tokens"], tokens) > 1024:
        chunks = math.ceil(tokens / 1024)
        consider(f"lmhead_chunks: {chunks} (1,024-token chunks)", lm_chunk_tokens=math.ceil(tokens / chunks))
    if s["mode"] == "full":
        consider(f"lora: true (rank {s['rank'] or 16}) instead of full fine-tuning", mode="lora", rank=s["rank"] or 16)
    avail = set(offload_available)
    if s["mode"] == "full" and not (s["layerwise_update"] or s["offload_optimizer"] or s["offload_master"]):
        consider("optimizer_layerwise: true", layerwise_update=True)
    if s["mode"] == "full":
        if not (Recipe(s["recipe"]) is Recipe.BF16 and s["master_dtype"] == "fp32"):
            avail.discard("offload_master")  # only the bf16 recipe keeps an fp32 master apart from its compute copy
        if "offload_optimizer" in avail and not s["offload_optimizer"]:
            consider("offload_optimizer: true", offload_optimizer=True)
        if "offload_master" in avail and not s["offload_master"]:
            consider("offload_master: true", offload_master=True)
        if {"offload_optimizer", "offload_master"} <= avail and not (s["offload_optimizer"] or s["offload_master"]):
            consider("offload_optimizer: true and offload_master: true", offload_optimizer=True, offload_master=True)
    elif "offload_base_weights" in avail and not s["offload_base"]:
        if s["recompute"] is Recompute.NONE:  # streaming needs recomputation (the weights are fetched again)
            consider("offload_base_weights: true with recompute: full", offload_base=True, recompute=Recompute.FULL)
        else:
            consider("offload_base_weights: true", offload_base=True)
    if s["recompute"] is not Recompute.FULL and s["batch"] > 1:
        # a combination, when no single change is enough
        if not out:
            b = s["batch"]
            while b > 1:
                b = max(1, b // 2)
                p = plan.with_settings(batch=b, recompute=Recompute.FULL)
                if p.fits(capacity):
                    out.append((f"recompute: full and per_device_train_batch_size: {b} with "
                                f"gradient_accumulation_steps multiplied by {math.ceil(s['batch'] / b)}", p.total))
                    break
    return out


def check_fits(plan: MemoryPlan, capacity: int | None, options_hint: bool = True, *,
               offload_available: Iterable[str] = ()) -> None:
    """Raise MemoryPlanError (before anything is allocated) when the estimate exceeds `capacity`.

    `offload_available`: the offload_* keys this build supports (only those are suggested).
    """
    if capacity is None or plan.fits(capacity):
        return
    msg = [f"the run needs an estimated {plan.total / GiB:.1f} GiB of device memory but the device has "
           f"{capacity / GiB:.1f} GiB:", format_plan(plan, capacity)]
    if options_hint:
        opts = fitting_options(plan, capacity, offload_available=offload_available)
        if opts:
            msg.append("Options that would fit (estimated peak):")
            msg += [f"  - {d}: {t / GiB:.1f} GiB" for d, t in opts]
        else:
            msg.append("No single option found that fits; a smaller model, a shorter sequence_len or more devices "
                       "(fsdp) are needed.")
    raise MemoryPlanError("\n".join(msg))


def device_capacity() -> int | None:
    """Bytes the first device's allocator may use (GPU), or None where the backend does not say (CPU)."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - some backends do not implement memory_stats
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"])
