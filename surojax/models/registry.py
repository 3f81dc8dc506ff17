"""Families: Hugging Face `model_type` -> architecture flags + the weight-name table.

A family is data, not a copied model file: every dense family runs through `decoder.Decoder`; what differs is
in the flags of its `Family` entry and which rows of the shared weight table apply to it.

Weight table rows map a Hugging Face tensor name to a path in the NNX state of `Decoder`:
    hf name ("{i}" is the layer index)   ->  state path (dotted)   transform
Per-layer rows are stacked on the leading L axis; per-expert rows ("{e}" in the name: one tensor per expert, as
Qwen3-MoE and Mixtral checkpoints are published) on the E axis after it. `transpose` turns HF's torch Linear layout
[out, in] into ours [in, out] (the last two axes; kernels are stored `x @ W`-ready; names below carry their axis
order). `half` (0 or 1) puts the tensor into that half of the last axis: the experts' gate and up projections
are stored fused, gate_up [.., D, 2F] = [gate | up].

A family may have a second table, `fused_weights` (Gemma 3's multimodal checkpoint: its published
`language_model.model.*` names beside transformers 5's in-memory `model.language_model.*`); a MoE family's is the
same model under the fused expert names transformers 5 keeps in memory (`mlp.experts.gate_up_proj` [E, 2F, D],
`mlp.experts.down_proj` [E, D, F]). The loader reads whichever table the checkpoint matches, the saver writes
`weights` (a MoE's published per-expert layout; gemma3's in-memory names, which PEFT's adapters use). A shared expert
(qwen2_moe, qwen3_5_moe: `mlp.shared_expert.{gate,up,down}_proj`, `mlp.shared_expert_gate`) has the same names in
both layouts (SHARED_EXPERT_WEIGHTS).

Hybrid families (Qwen3.5: Gated DeltaNet and gated attention layers) hold their layers in two stacks: `layers`
(the attention blocks) and `linear_layers` (the DeltaNet blocks). A per-layer row names its stack by the first part
of its path; `stack_layers(cfg, stack)` is the one map from a stack to the HF layer indices ("{i}") it holds, in
its row order, and `row_layers(cfg, row)` a row's indices: every reader and writer of per-layer tensors (HF
checkpoints, GGUF, PEFT adapters, quantisation) goes through it. LFM2 likewise: `layers` (its attention layers)
and `conv_layers` (its short-convolution layers).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WeightRow:
    hf: str  # HF tensor name; "{i}" marks a per-layer tensor
    path: str  # dotted path in the Decoder's state
    transpose: bool = False
    when: str | None = None  # ModelConfig flag that must be true for this tensor to exist
    half: int | None = None  # 0 / 1: the first / second half of the state's last axis

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf

    @property
    def stack(self) -> str | None:
        """The layer stack a per-layer row's tensors are stacked in (`layers`, `linear_layers`); None otherwise."""
        return self.path.split(".", 1)[0] if self.per_layer else None


# One table for all llama-style families. Axis orders: kernel_DN... are [in, out].
LLAMA_STYLE_WEIGHTS: tuple[WeightRow, ...] = (
    WeightRow("model.embed_tokens.weight", "embed.embedding"),  # [V, D]
    WeightRow("model.layers.{i}.input_layernorm.weight", "layers.attn_norm.scale"),  # [L, D]
    WeightRow("model.layers.{i}.self_attn.q_proj.weight", "layers.attn.q_proj.kernel", True),  # [L, D, N*H]
    WeightRow("model.layers.{i}.self_attn.k_proj.weight", "layers.attn.k_proj.kernel", True),  # [L, D, K*H]
    WeightRow("model.layers.{i}.self_attn.v_proj.weight", "layers.attn.v_proj.kernel", True),  # [L, D, K*H]
    WeightRow("model.layers.{i}.self_attn.o_proj.weight", "layers.attn.o_proj.kernel", True),  # [L, N*H, D]
    WeightRow("model.layers.{i}.self_attn.q_proj.bias", "layers.attn.q_proj.bias", when="attention_bias"),
    WeightRow("model.layers.{i}.self_attn.k_proj.bias", "layers.attn.k_proj.bias", when="attention_bias"),
    WeightRow("model.layers.{i}.self_attn.v_proj.bias", "layers.attn.v_proj.bias", when="attention_bias"),
    WeightRow("model.layers.{i}.self_attn.q_norm.weight", "layers.attn.q_norm.scale", when="qk_norm"),  # [L, H]
    WeightRow("model.layers.{i}.self_attn.k_norm.weight", "layers.attn.k_norm.scale", when="qk_norm"),  # [L, H]
    WeightRow("model.layers.{i}.post_attention_layernorm.weight", "layers.mlp_norm.scale"),  # [L, D]
    WeightRow("model.layers.{i}.mlp.gate_proj.weight", "layers.mlp.gate_proj.kernel", True),  # [L, D, F]
    WeightRow("model.layers.{i}.mlp.up_proj.weight", "layers.mlp.up_proj.kernel", True),  # [L, D, F]
    WeightRow("model.layers.{i}.mlp.down_proj.weight", "layers.mlp.down_proj.kernel", True),  # [L, F, D]
    WeightRow("model.norm.weight", "final_norm.scale"),  # [D]
    WeightRow("lm_head.weight", "lm_head.kernel", True, when="untied"),  # [D, V]
)

# The attention and norm rows every MoE family shares with the dense ones (the MLP rows replaced by its own).
ATTENTION_WEIGHTS: tuple[WeightRow, ...] = tuple(r for r in LLAMA_STYLE_WEIGHTS if ".mlp." not in r.hf)

_EXPERTS = "layers.mlp.experts"
QWEN3_MOE_WEIGHTS: tuple[WeightRow, ...] = ATTENTION_WEIGHTS + (
    WeightRow("model.layers.{i}.mlp.gate.weight", "layers.mlp.router.kernel", True),  # [L, D, E]
    WeightRow("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", f"{_EXPERTS}.gate_up_proj.kernel", True,
              half=0),  # [L, E, D, 2F]
    WeightRow("model.layers.{i}.mlp.experts.{e}.up_proj.weight", f"{_EXPERTS}.gate_up_proj.kernel", True, half=1),
    WeightRow("model.layers.{i}.mlp.experts.{e}.down_proj.weight", f"{_EXPERTS}.down_proj.kernel", True),  # [L, E, F, D]
)
MIXTRAL_WEIGHTS: tuple[WeightRow, ...] = ATTENTION_WEIGHTS + (
    WeightRow("model.layers.{i}.block_sparse_moe.gate.weight", "layers.mlp.router.kernel", True),
    WeightRow("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", f"{_EXPERTS}.gate_up_proj.kernel", True,
              half=0),
    WeightRow("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", f"{_EXPERTS}.gate_up_proj.kernel", True,
              half=1),
    WeightRow("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", f"{_EXPERTS}.down_proj.kernel", True),
)
# A shared expert beside the routed ones (MoEConfig.shared_expert_intermediate_size): a SwiGLU MLP and its sigmoid gate
# Linear(D, 1). Published and transformers-5 checkpoints name them alike.
_SHARED = "layers.mlp.shared_expert"
SHARED_EXPERT_WEIGHTS: tuple[WeightRow, ...] = (
    WeightRow("model.layers.{i}.mlp.shared_expert.gate_proj.weight", f"{_SHARED}.gate_proj.kernel", True),  # [L, D, Fs]
    WeightRow("model.layers.{i}.mlp.shared_expert.up_proj.weight", f"{_SHARED}.up_proj.kernel", True),  # [L, D, Fs]
    WeightRow("model.layers.{i}.mlp.shared_expert.down_proj.weight", f"{_SHARED}.down_proj.kernel", True),  # [L, Fs, D]
    WeightRow("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.mlp.shared_expert_gate.kernel",
              True),  # [L, D, 1]
)
# transformers 5's in-memory names (both families): router `mlp.gate`, fused experts [E, out, in].
FUSED_MOE_WEIGHTS: tuple[WeightRow, ...] = ATTENTION_WEIGHTS + (
    WeightRow("model.layers.{i}.mlp.gate.weight", "layers.mlp.router.kernel", True),
    WeightRow("model.layers.{i}.mlp.experts.gate_up_proj", f"{_EXPERTS}.gate_up_proj.kernel", True),  # [E, 2F, D]
    WeightRow("model.layers.{i}.mlp.experts.down_proj", f"{_EXPERTS}.down_proj.kernel", True),  # [E, D, F]
)
# qwen2_moe: qwen3_moe's expert names (no q/k norm: those rows need `qk_norm`) plus the shared expert
QWEN2_MOE_WEIGHTS: tuple[WeightRow, ...] = QWEN3_MOE_WEIGHTS + SHARED_EXPERT_WEIGHTS
FUSED_QWEN2_MOE_WEIGHTS: tuple[WeightRow, ...] = FUSED_MOE_WEIGHTS + SHARED_EXPERT_WEIGHTS

# gpt_oss: q/k/v/o biases, a sink logit per query head, the router `mlp.router` with a bias, the experts fused and
# stored `x @ W`-ready (no transpose) with gate / up interleaved on the last axis, and biased.
GPT_OSS_WEIGHTS: tuple[WeightRow, ...] = ATTENTION_WEIGHTS + (
    WeightRow("model.layers.{i}.self_attn.o_proj.bias", "layers.attn.o_proj.bias", when="o_proj_bias"),  # [L, D]
    WeightRow("model.layers.{i}.self_attn.sinks", "layers.attn.sinks", when="attention_sinks"),  # [L, N]
    WeightRow("model.layers.{i}.mlp.router.weight", "layers.mlp.router.kernel", True),  # [L, D, E]
    WeightRow("model.layers.{i}.mlp.router.bias", "layers.mlp.router.bias", when="router_bias"),  # [L, E]
    WeightRow("model.layers.{i}.mlp.experts.gate_up_proj", f"{_EXPERTS}.gate_up_proj.kernel"),  # [L, E, D, 2F]
    WeightRow("model.layers.{i}.mlp.experts.gate_up_proj_bias", f"{_EXPERTS}.gate_up_proj.bias",
              when="expert_bias"),  # [L, E, 2F]
    WeightRow("model.layers.{i}.mlp.experts.down_proj", f"{_EXPERTS}.down_proj.kernel"),  # [L, E, F, D]
    WeightRow("model.layers.{i}.mlp.experts.down_proj_bias", f"{_EXPERTS}.down_proj.bias", when="expert_bias"),
)



def qwen3_vl_weights(prefix: str, *, moe: bool = False, fused: bool = False) -> tuple[WeightRow, ...]:
    """Qwen3-VL's text model under `prefix` (`model.language_model.` in Qwen3VLForConditionalGeneration; `model.`
    for the text-only table the config round trip names): Qwen3's rows (q/k norms, untied head unless tied). With
    `moe` (qwen3_vl_moe) every layer's MLP is the sparse MoE: the router `mlp.gate` [E, D] and the experts as one
    tensor per layer, published `x @ W`-ready (`mlp.experts.gate_up_proj` [E, D, 2F] = [gate | up],
    `mlp.experts.down_proj` [E, F, D]; transformers 5.17 transposes them on load) or, with `fused`, as transformers
    holds them in memory and its save_pretrained writes them ([E, 2F, D] / [E, D, F])."""
    rows = LLAMA_STYLE_WEIGHTS if not moe else ATTENTION_WEIGHTS + (
        WeightRow("model.layers.{i}.mlp.gate.weight", "layers.mlp.router.kernel", True),  # [L, D, E]
        WeightRow("model.layers.{i}.mlp.experts.gate_up_proj", f"{_EXPERTS}.gate_up_proj.kernel", fused),
        WeightRow("model.layers.{i}.mlp.experts.down_proj", f"{_EXPERTS}.down_proj.kernel", fused))
    return tuple(dataclasses.replace(r, hf=prefix + r.hf.removeprefix("model.")) if r.hf.startswith("model.") else r
                 for r in rows)


def qwen3_5_weights(prefix: str, *, moe: bool = False, fused: bool = False) -> tuple[WeightRow, ...]:
    """Qwen3.5's hybrid under `prefix` (`model.`: Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM; `model.language_model.`:
    the text backbone of the ConditionalGeneration models). Attention layers (stack `layers`): q_proj [D, 2 N H] =
    query | output gate per head, q/k norms; DeltaNet layers (stack `linear_layers`): in_proj_qkv
    [D, 2 Hk Dk + Hv Dv], in_proj_z [D, Hv Dv], in_proj_b / in_proj_a [D, Hv], the depthwise conv kernel as stored
    [C, 1, K], dt_bias / A_log [Hv], the gated norm [Dv], out_proj [Hv Dv, D]. Both stacks: the two norms and the
    MLP: the dense SwiGLU, or with `moe` (qwen3_5_moe) the sparse MoE in every layer: the router `mlp.gate`, the
    routed experts (per expert as published, or with `fused` transformers 5's in-memory `mlp.experts.gate_up_proj`
    [E, 2F, D] / `down_proj` [E, D, F]) and the shared expert with its sigmoid gate."""
    layer = prefix + "layers.{i}."
    both = []
    for stack in ("layers", "linear_layers"):
        both += [WeightRow(layer + "input_layernorm.weight", f"{stack}.attn_norm.scale"),
                 WeightRow(layer + "post_attention_layernorm.weight", f"{stack}.mlp_norm.scale")]
        if moe:
            both += _moe_rows(layer, stack, fused)
        else:
            both += [WeightRow(layer + f"mlp.{m}.weight", f"{stack}.mlp.{m}.kernel", True)
                     for m in ("gate_proj", "up_proj", "down_proj")]
    attn = [WeightRow(layer + f"self_attn.{m}.weight", f"layers.attn.{m}.kernel", True)
            for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    attn += [WeightRow(layer + f"self_attn.{m}.weight", f"layers.attn.{m}.scale") for m in ("q_norm", "k_norm")]
    la = "linear_layers.linear_attn"
    linear = [WeightRow(layer + f"linear_attn.{m}.weight", f"{la}.{m}.kernel", True)
              for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
    linear += [WeightRow(layer + "linear_attn.conv1d.weight", f"{la}.conv1d.kernel"),  # [C, 1, K] as stored
               WeightRow(layer + "linear_attn.dt_bias", f"{la}.dt_bias"),
               WeightRow(layer + "linear_attn.A_log", f"{la}.A_log"),
               WeightRow(layer + "linear_attn.norm.weight", f"{la}.norm.scale")]
    return (WeightRow(prefix + "embed_tokens.weight", "embed.embedding"), *both, *attn, *linear,
            WeightRow(prefix + "norm.weight", "final_norm.scale"),
            WeightRow("lm_head.weight", "lm_head.kernel", True, when="untied"))


# Gemma 4's full-attention layers when shaped unlike its sliding ones (ModelConfig.global_attention: their own head
# size / kv heads / no v_proj): a stack of their own beside `layers` (which then holds the sliding layers)
GLOBAL_STACK = "global_layers"
# and its KV-shared layers (`num_kv_shared_layers`: no k / v projections), sliding / full (ModelConfig.layer_stack)
SHARED_STACK, SHARED_GLOBAL_STACK = "shared_layers", "shared_global_layers"
GEMMA4_STACKS = ("layers", GLOBAL_STACK, SHARED_STACK, SHARED_GLOBAL_STACK)

# lfm2_moe's dense leading layers (`num_dense_layers`) live in stacks of their own, one per mixer kind: the stack
# of that kind's sparse layers -> the stack of its dense ones (ModelConfig.dense_layers; decoder.layer_pattern)
DENSE_STACKS: dict[str, str] = {"layers": "dense_layers", "conv_layers": "dense_conv_layers"}


def lfm2_weights(*, moe: bool = False, fused: bool = False) -> tuple[WeightRow, ...]:
    """LFM2 (Lfm2ForCausalLM) under `model.`: both stacks (`layers` = the attention layers, `conv_layers` = the
    short-convolution layers) have `operator_norm` / `ffn_norm` and the SwiGLU `feed_forward.w1` (gate) / `w3` (up)
    / `w2` (down); attention: q/k/v_proj, `out_proj`, `q_layernorm` / `k_layernorm`; the short conv: `in_proj`
    [3D, D], the depthwise kernel `conv.conv.weight` [D, 1, K] as stored, `out_proj` [D, D], their biases with
    `conv_bias`. The final norm is `model.embedding_norm`; the head tied unless the config unties it.

    With `moe` (lfm2_moe) the feed-forward of `layers` / `conv_layers` is the MoE: the router `feed_forward.gate`
    [E, D], the `feed_forward.expert_bias` buffer [E] (added to the scores for the choice only), the experts per
    expert as published (`feed_forward.experts.{e}.w1` / `w3` / `w2`) or with `fused` transformers 5's in-memory
    `feed_forward.experts.gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F]; its dense leading layers
    (`num_dense_layers`) are the stacks `dense_layers` / `dense_conv_layers` with the SwiGLU rows."""
    layer = "model.layers.{i}."
    kinds = {"layers": "layers", "conv_layers": "conv_layers"}  # stack -> its mixer kind
    if moe:
        kinds |= {dense: kind for kind, dense in DENSE_STACKS.items()}
    rows = []
    for stack, kind in kinds.items():
        rows += [WeightRow(layer + "operator_norm.weight", f"{stack}.attn_norm.scale"),
                 WeightRow(layer + "ffn_norm.weight", f"{stack}.mlp_norm.scale")]
        if moe and stack == kind:
            rows += _lfm2_moe_rows(layer + "feed_forward.", stack, fused)
        else:
            rows += [WeightRow(layer + f"feed_forward.{w}.weight", f"{stack}.mlp.{m}.kernel", True)
                     for w, m in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]
        if kind == "layers":
            rows += [WeightRow(layer + f"self_attn.{m}.weight", f"{stack}.attn.{m}.kernel", True)
                     for m in ("q_proj", "k_proj", "v_proj")]
            rows += [WeightRow(layer + "self_attn.out_proj.weight", f"{stack}.attn.o_proj.kernel", True),
                     WeightRow(layer + "self_attn.q_layernorm.weight", f"{stack}.attn.q_norm.scale"),
                     WeightRow(layer + "self_attn.k_layernorm.weight", f"{stack}.attn.k_norm.scale")]
            continue
        for m in ("in_proj", "out_proj"):
            rows += [WeightRow(layer + f"conv.{m}.weight", f"{stack}.conv.{m}.kernel", True),
                     WeightRow(layer + f"conv.{m}.bias", f"{stack}.conv.{m}.bias", when="conv_bias")]
        rows += [WeightRow(layer + "conv.conv.weight", f"{stack}.conv.conv.kernel"),  # [D, 1, K] as stored
                 WeightRow(layer + "conv.conv.bias", f"{stack}.conv.conv.bias", when="conv_bias")]
    return (WeightRow("model.embed_tokens.weight", "embed.embedding"), *rows,
            WeightRow("model.embedding_norm.weight", "final_norm.scale"),
            WeightRow("lm_head.weight", "lm_head.kernel", True, when="untied"))


def _routed_rows(prefix: str, stack: str, fused: bool, names: tuple[str, str, str]) -> list[WeightRow]:
    """One stack's routed experts under `prefix` (the layer's MoE module prefix): transformers 5's fused
    `experts.gate_up_proj` [E, 2F, D] / `experts.down_proj` [E, D, F], or per expert as published, `names` the
    gate / up / down projections' (qwen: gate_proj / up_proj / down_proj; lfm2_moe: w1 / w3 / w2)."""
    experts = f"{stack}.mlp.experts"
    if fused:
        return [WeightRow(prefix + "experts.gate_up_proj", f"{experts}.gate_up_proj.kernel", True),
                WeightRow(prefix + "experts.down_proj", f"{experts}.down_proj.kernel", True)]
    gate, up, down = (prefix + "experts.{e}." + n + ".weight" for n in names)
    return [WeightRow(gate, f"{experts}.gate_up_proj.kernel", True, half=0),
            WeightRow(up, f"{experts}.gate_up_proj.kernel", True, half=1),
            WeightRow(down, f"{experts}.down_proj.kernel", True)]


def _lfm2_moe_rows(ff: str, stack: str, fused: bool) -> list[WeightRow]:
    """One stack's lfm2_moe feed-forward rows under `ff` (the layer's `feed_forward.` prefix)."""
    return [WeightRow(ff + "gate.weight", f"{stack}.mlp.router.kernel", True),  # [E, D]
            WeightRow(ff + "expert_bias", f"{stack}.mlp.router.selection_bias", when="selection_bias"),  # [E]
            *_routed_rows(ff, stack, fused, ("w1", "w3", "w2"))]


def _moe_rows(layer: str, stack: str, fused: bool) -> list[WeightRow]:
    """One stack's sparse-MoE rows under the layer prefix `layer` (qwen2_moe's names: router `mlp.gate`, the experts,
    the shared expert and its gate), per expert or fused."""
    mlp = layer + "mlp."
    routed = _routed_rows(mlp, stack, fused, ("gate_proj", "up_proj", "down_proj"))
    shared = [WeightRow(mlp + f"shared_expert.{m}.weight", f"{stack}.mlp.shared_expert.{m}.kernel", True)
              for m in ("gate_proj", "up_proj", "down_proj")]
    return [WeightRow(mlp + "gate.weight", f"{stack}.mlp.router.kernel", True), *routed, *shared,
            WeightRow(mlp + "shared_expert_gate.weight", f"{stack}.mlp.shared_expert_gate.kernel", True)]


def gemma3_weights(prefix: str, head: str = "lm_head.weight") -> tuple[WeightRow, ...]:
    """Gemma 3's text model under `prefix` (`model.`: Gemma3ForCausalLM; `model.language_model.`: the text backbone
    of Gemma3ForConditionalGeneration as transformers 5 holds it in memory; `language_model.model.`: the published
    layout, with the head `language_model.lm_head.weight`). The llama rows with q/k norms, except the norms: four
    per block, `input_layernorm` (before attention), `post_attention_layernorm` (on the attention's output, before
    the residual add: not llama's pre-MLP norm), `pre_feedforward_layernorm`, `post_feedforward_layernorm`."""
    layer = prefix + "layers.{i}."
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
             "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"}
    return (WeightRow(prefix + "embed_tokens.weight", "embed.embedding"),
            *(WeightRow(layer + f"{hf}.weight", f"layers.{ours}.scale") for hf, ours in norms.items()),
            *(WeightRow(layer + f"self_attn.{m}.weight", f"layers.attn.{m}.kernel", True)
              for m in ("q_proj", "k_proj", "v_proj", "o_proj")),
            *(WeightRow(layer + f"self_attn.{m}.weight", f"layers.attn.{m}.scale") for m in ("q_norm", "k_norm")),
            *(WeightRow(layer + f"mlp.{m}.weight", f"layers.mlp.{m}.kernel", True)
              for m in ("gate_proj", "up_proj", "down_proj")),
            WeightRow(prefix + "norm.weight", "final_norm.scale"),
            WeightRow(head, "lm_head.kernel", True, when="untied"))


def gemma4_weights(prefix: str) -> tuple[WeightRow, ...]:
    """Gemma 4's text model under `prefix` (`model.`: Gemma4ForCausalLM; `model.language_model.`: the text
    backbone of Gemma4ForConditionalGeneration): Gemma 3's rows (the v norm has no weight) and each layer's
    `layer_scalar` ([1], a buffer transformers saves) that multiplies the layer's output. With the MoE block
    (`enable_moe_block`, rows `when` moe_block): the router `router.proj` [E, D], its input scale `router.scale` [D]
    and `router.per_expert_scale` [E], the fused experts `experts.gate_up_proj` [E, 2F, D] / `experts.down_proj`
    [E, D, F], and three norms: `pre_feedforward_layernorm_2` (the experts' input), `post_feedforward_layernorm_1`
    (the dense MLP's output), `post_feedforward_layernorm_2` (the experts' output).

    The same per-layer names are read into each of Gemma 4's stacks (GEMMA4_STACKS; `ModelConfig.layer_stack`):
    `global_layers` (full layers of their own shape; no v_proj under attention_k_eq_v: `when` global_v_proj),
    `shared_layers` / `shared_global_layers` (KV-shared layers: no k_proj / v_proj / k_norm). Per-layer input
    embeddings (`when` ple): the table `embed_tokens_per_layer` [V_p, L P], `per_layer_model_projection` [L P, D],
    `per_layer_projection_norm` [P], and per layer `per_layer_input_gate` [P, D], `per_layer_projection` [D, P],
    `post_per_layer_input_norm` [D]."""
    layer = prefix + "layers.{i}."
    base = [r for r in gemma3_weights(prefix)[:-1] if r.per_layer] + [
        WeightRow(layer + "layer_scalar", "layers.layer_scalar"),
        WeightRow(layer + "per_layer_input_gate.weight", "layers.ple_gate.kernel", True, when="ple"),
        WeightRow(layer + "per_layer_projection.weight", "layers.ple_projection.kernel", True, when="ple"),
        WeightRow(layer + "post_per_layer_input_norm.weight", "layers.ple_norm.scale", when="ple"),
        WeightRow(layer + "router.proj.weight", "layers.moe.router.kernel", True, when="moe_block"),
        WeightRow(layer + "router.scale", "layers.moe.router.scale", when="moe_block"),
        WeightRow(layer + "router.per_expert_scale", "layers.moe.router.per_expert_scale", when="moe_block"),
        WeightRow(layer + "experts.gate_up_proj", "layers.moe.experts.gate_up_proj.kernel", True, when="moe_block"),
        WeightRow(layer + "experts.down_proj", "layers.moe.experts.down_proj.kernel", True, when="moe_block"),
        WeightRow(layer + "pre_feedforward_layernorm_2.weight", "layers.moe_pre_norm.scale", when="moe_block"),
        WeightRow(layer + "post_feedforward_layernorm_1.weight", "layers.mlp_post_norm_dense.scale", when="moe_block"),
        WeightRow(layer + "post_feedforward_layernorm_2.weight", "layers.moe_post_norm.scale", when="moe_block")]
    rows = [WeightRow(prefix + "embed_tokens.weight", "embed.embedding"),
            WeightRow(prefix + "embed_tokens_per_layer.weight", "embed_per_layer.embedding", when="ple"),
            WeightRow(prefix + "per_layer_model_projection.weight", "per_layer_model_projection.kernel", True,
                      when="ple"),
            WeightRow(prefix + "per_layer_projection_norm.weight", "per_layer_projection_norm.scale", when="ple")]
    kv_only = tuple(f"self_attn.{m}." for m in ("k_proj", "v_proj", "k_norm"))
    for stack in GEMMA4_STACKS:
        for r in base:
            if stack.startswith("shared") and any(m in r.hf for m in kv_only):
                continue  # a KV-shared layer computes no keys / values
            when = r.when if ".v_proj." not in r.hf else "global_v_proj" if "global" in stack else "v_proj"
            rows.append(dataclasses.replace(r, path=stack + r.path.removeprefix("layers"), when=when))
    return (*rows, WeightRow(prefix + "norm.weight", "final_norm.scale"),
            WeightRow("lm_head.weight", "lm_head.kernel", True, when="untied"))


# HF module names users put in `lora_target_modules`, and where each lives in the Decoder.
LINEAR_MODULES: dict[str, str] = {
    "q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.o_proj",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}
# The Gated DeltaNet projections of a hybrid model's `linear_layers` (HF names; path inside that stack's block).
LINEAR_ATTENTION_MODULES: dict[str, str] = {
    m: f"linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}
# LFM2's short-convolution projections (its `conv_layers`): our target name -> path inside that stack's block. The
# names are dotted (its HF module names in_proj / out_proj collide with the DeltaNet's and the attention's out_proj);
# they are also PEFT's `target_modules` entries (`model.layers.{i}.conv.in_proj` matched by its end).
SHORT_CONV_MODULES: dict[str, str] = {f"conv.{m}": f"conv.{m}" for m in ("in_proj", "out_proj")}
# A MoE model's expert projections (ExpertLinear, [E, in, out] per layer) as LoRA targets: our target name -> path
# in the Decoder. The path is also PEFT's `target_parameters` entry for transformers 5's fused experts.
EXPERT_MODULES: dict[str, str] = {
    "experts.gate_up_proj": "mlp.experts.gate_up_proj", "experts.down_proj": "mlp.experts.down_proj",
}
# A shared expert's projections (plain Linears [D, Fs] / [Fs, D] per layer) as LoRA targets: the name is also PEFT's
# `target_modules` entry (it matches `model.layers.{i}.mlp.shared_expert.gate_proj` by its end).
SHARED_EXPERT_MODULES: dict[str, str] = {
    f"shared_expert.{p}": f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")
}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # HF model_type
    hf_architecture: str  # `architectures[0]` written into config.json
    attention_bias: bool = False  # default when config.json does not say
    attention_bias_key: bool = True  # config.json has a key for the q/k/v bias (`bias_key`)
    bias_key: str = "attention_bias"  # its name (qwen2_moe: `qkv_bias`)
    qk_norm: bool = False
    sliding_window: bool = False  # honours config.json's `sliding_window`
    attention_sinks: bool = False  # a learned sink logit per query head (`self_attn.sinks`)
    o_proj_bias: bool = False  # `attention_bias` covers o_proj too
    tie_default: bool = False
    weights: tuple[WeightRow, ...] = LLAMA_STYLE_WEIGHTS
    fused_weights: tuple[WeightRow, ...] = ()  # a second accepted naming (MoE: transformers 5's fused experts)
    moe: str | None = None  # the MoE config spelling (ModelConfig.moe_from_hf); None: a dense family
    # config.json has the dense MLP's `intermediate_size` (qwen3_5_moe's has none: every layer is sparse;
    # ModelConfig.intermediate_size is then 0)
    intermediate_size_key: bool = True
    # Qwen3.5's hybrid: `layer_types` of linear_attention / full_attention layers (two stacks), the attention's
    # sigmoid output gate, (1 + w) RMSNorms, partial rotary (this default when config.json does not say)
    hybrid: bool = False
    partial_rotary_default: float = 1.0
    text_config: bool = False  # config.json nests the text model's keys under `text_config` (a multimodal model)
    # Gemma 3 (config.Gemma3Text): sandwich norms, (1 + w) norms, embeddings x sqrt(D), GeGLU, query_pre_attn_scalar,
    # a rope per layer type (full / sliding attention)
    gemma3: bool = False
    # Gemma 4 (config.Gemma4Text): Gemma 3's block with plain-w norms, the v norm, softmax scale 1, layer scalars
    gemma4: bool = False
    # tensors of the checkpoint that are not the text model's (a vision tower, MTP heads): skipped, with a log line
    skipped_prefixes: tuple[str, ...] = ()
    # LFM2: `layer_types` of conv / full_attention layers (two stacks: `conv_layers` and `layers`), the
    # feed-forward width from the block_* keys, `norm_eps`
    short_conv: bool = False
    norm_eps_key: str = "rms_norm_eps"  # config.json's RMSNorm epsilon key
    rope_theta_default: float = 10000.0  # transformers' default when config.json does not say
    # Multimodal rope: the default `mrope_section` (ModelConfig.mrope_section) when rope_parameters has none; None:
    # a family without it
    mrope: tuple[int, int, int] | None = None
    # a vision tower under `model.visual.` (models/vision/): loaded with the text model when the checkpoint holds it
    vision: bool = False


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family("qwen2", "Qwen2ForCausalLM", attention_bias=True, attention_bias_key=False),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
        Family("mistral", "MistralForCausalLM", attention_bias_key=False, sliding_window=True),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, weights=QWEN3_MOE_WEIGHTS,
               fused_weights=FUSED_MOE_WEIGHTS, moe="qwen3_moe"),
        Family("mixtral", "MixtralForCausalLM", attention_bias_key=False, sliding_window=True,
               weights=MIXTRAL_WEIGHTS, fused_weights=FUSED_MOE_WEIGHTS, moe="mixtral"),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", attention_bias=True, bias_key="qkv_bias",
               weights=QWEN2_MOE_WEIGHTS, fused_weights=FUSED_QWEN2_MOE_WEIGHTS, moe="qwen2_moe"),
        Family("gpt_oss", "GptOssForCausalLM", attention_bias=True, attention_sinks=True, o_proj_bias=True,
               weights=GPT_OSS_WEIGHTS, moe="gpt_oss"),
        Family("qwen3_5_text", "Qwen3_5ForCausalLM", attention_bias=False, qk_norm=True, hybrid=True,
               partial_rotary_default=0.25, weights=qwen3_5_weights("model."), skipped_prefixes=("mtp.",),
               mrope=(11, 11, 10)),
        Family("qwen3_5", "Qwen3_5ForConditionalGeneration", attention_bias=False, qk_norm=True, hybrid=True,
               partial_rotary_default=0.25, weights=qwen3_5_weights("model.language_model."), text_config=True,
               skipped_prefixes=("mtp.",), mrope=(11, 11, 10), vision=True),
        Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", attention_bias=False, qk_norm=True, hybrid=True,
               partial_rotary_default=0.25, weights=qwen3_5_weights("model.", moe=True),
               fused_weights=qwen3_5_weights("model.", moe=True, fused=True), moe="qwen3_5_moe",
               intermediate_size_key=False, skipped_prefixes=("mtp.",), mrope=(11, 11, 10)),
        Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", attention_bias=False, qk_norm=True, hybrid=True,
               partial_rotary_default=0.25, weights=qwen3_5_weights("model.language_model.", moe=True),
               fused_weights=qwen3_5_weights("model.language_model.", moe=True, fused=True), moe="qwen3_5_moe",
               intermediate_size_key=False, text_config=True, skipped_prefixes=("mtp.",), mrope=(11, 11, 10),
               vision=True),
        # Qwen3-VL: Qwen3's text model (q/k norms) with M-RoPE and deepstack, its vision tower under model.visual.
        Family("qwen3_vl", "Qwen3VLForConditionalGeneration", qk_norm=True, text_config=True,
               weights=qwen3_vl_weights("model.language_model."), mrope=(24, 20, 20), vision=True,
               rope_theta_default=5e5),
        Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", qk_norm=True, text_config=True,
               weights=qwen3_vl_weights("model.language_model.", moe=True),
               fused_weights=qwen3_vl_weights("model.language_model.", moe=True, fused=True), moe="qwen3_vl_moe",
               mrope=(24, 20, 20), vision=True, rope_theta_default=5e5),
        # their text models (transformers' Qwen3VLTextConfig / Qwen3VLMoeTextConfig: `text_config` of the above)
        Family("qwen3_vl_text", "Qwen3VLTextModel", qk_norm=True, weights=qwen3_vl_weights("model."),
               mrope=(24, 20, 20), rope_theta_default=5e5),
        Family("qwen3_vl_moe_text", "Qwen3VLMoeTextModel", qk_norm=True, weights=qwen3_vl_weights("model.", moe=True),
               fused_weights=qwen3_vl_weights("model.", moe=True, fused=True), moe="qwen3_vl_moe",
               mrope=(24, 20, 20), rope_theta_default=5e5),
        Family("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, tie_default=True, gemma3=True,
               weights=gemma3_weights("model.")),
        # the text backbone; `fused_weights` here is the second accepted naming: the published layout
        Family("gemma3", "Gemma3ForConditionalGeneration", qk_norm=True, tie_default=True, gemma3=True,
               text_config=True, weights=gemma3_weights("model.language_model."),
               fused_weights=gemma3_weights("language_model.model.", "language_model.lm_head.weight"),
               skipped_prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                                 "multi_modal_projector.")),
        Family("gemma4_text", "Gemma4ForCausalLM", qk_norm=True, tie_default=True, gemma4=True,
               weights=gemma4_weights("model.")),
        Family("gemma4", "Gemma4ForConditionalGeneration", qk_norm=True, tie_default=True, gemma4=True,
               text_config=True, weights=gemma4_weights("model.language_model."),
               skipped_prefixes=("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                 "model.embed_audio.")),
        Family("lfm2", "Lfm2ForCausalLM", attention_bias_key=False, qk_norm=True, tie_default=True,
               weights=lfm2_weights(), short_conv=True, norm_eps_key="norm_eps", rope_theta_default=1e6),
        Family("lfm2_moe", "Lfm2MoeForCausalLM", attention_bias_key=False, qk_norm=True, tie_default=True,
               weights=lfm2_weights(moe=True), fused_weights=lfm2_weights(moe=True, fused=True), moe="lfm2_moe",
               short_conv=True, norm_eps_key="norm_eps", rope_theta_default=1e6),
    )
}


class UnsupportedModelError(ValueError):
    is_user_error = True


def family_for(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def stack_layers(cfg, stack: str) -> tuple[int, ...]:
    """The HF layer indices the layer stack `stack` holds, in its row order: `layers` every layer of a one-stack
    model, the full-attention layers of a hybrid; `linear_layers` a hybrid's Gated DeltaNet layers, `conv_layers`
    LFM2's short-convolution layers. lfm2_moe's dense leading layers (the first `dense_layers`) are in
    `dense_layers` / `dense_conv_layers` (DENSE_STACKS), the rest of their kind in `layers` / `conv_layers`."""
    la = getattr(cfg, "linear_attention", None)
    sc = getattr(cfg, "short_conv", None)
    if _gemma4_stacks(cfg):  # Gemma 4: ModelConfig.layer_stack says which stack holds each layer
        if stack not in GEMMA4_STACKS:
            raise ValueError(f"{cfg.model_type}'s layer stacks are {', '.join(GEMMA4_STACKS)}; asked for {stack!r}")
        return tuple(i for i in range(cfg.num_layers) if cfg.layer_stack(i) == stack)
    if la is None and sc is None:
        if stack != "layers":
            raise ValueError(f"{cfg.model_type} has one layer stack, `layers`; asked for {stack!r}")
        return tuple(range(cfg.num_layers))
    other = "linear_layers" if la is not None else "conv_layers"
    dense = getattr(cfg, "dense_layers", 0)
    kinds = {"layers": "layers", other: other} | ({v: k for k, v in DENSE_STACKS.items()} if dense else {})
    if stack not in kinds:
        raise ValueError(f"{cfg.model_type}'s layer stacks are {', '.join(f'`{k}`' for k in kinds)}; asked for "
                         f"{stack!r}")
    mine = kinds[stack] == other
    in_stack = (lambda i: i < dense) if stack in DENSE_STACKS.values() else (lambda i: i >= dense)
    return tuple(i for i, is_other in enumerate((la or sc).layers) if is_other == mine and in_stack(i))


def _gemma4_stacks(cfg) -> bool:
    """Gemma 4 with layers outside `layers` (full layers of their own shape, KV-shared layers)."""
    return getattr(cfg, "global_attention", None) is not None or getattr(cfg, "kv_shared_layers", 0) > 0


def model_stacks(cfg) -> tuple[str, ...]:
    """The layer stacks a model of this config has, each holding at least one layer (`layers` first)."""
    la, sc = getattr(cfg, "linear_attention", None), getattr(cfg, "short_conv", None)
    names = ("layers",) + (("linear_layers",) if la is not None else ()) + (("conv_layers",) if sc is not None else ())
    if _gemma4_stacks(cfg):
        return tuple(n for n in GEMMA4_STACKS if stack_layers(cfg, n))
    if getattr(cfg, "dense_layers", 0):
        names += tuple(DENSE_STACKS[n] for n in names if n in DENSE_STACKS)
    return tuple(n for n in names if n in ("layers", "linear_layers", "conv_layers") or stack_layers(cfg, n))


def row_layers(cfg, row: WeightRow) -> tuple[int | None, ...]:
    """The HF layer indices of a row's tensors (its stack's, `stack_layers`); (None,) for a row outside the stacks."""
    return stack_layers(cfg, row.stack) if row.per_layer else (None,)


def weight_rows(cfg, *, fused: bool = False) -> list[WeightRow]:
    """The table rows that exist for this config (bias / qk-norm / untied head filtered by its flags); `fused`:
    the family's second table (transformers 5's fused expert names)."""
    moe = cfg.moe
    flags = {"attention_bias": cfg.attention_bias, "qk_norm": cfg.qk_norm, "untied": not cfg.tie_word_embeddings,
             "router_bias": bool(moe and moe.router_bias), "expert_bias": bool(moe and moe.expert_bias),
             "selection_bias": bool(moe and moe.selection_bias), "moe_block": getattr(cfg, "moe_beside_mlp", False),
             "o_proj_bias": cfg.o_proj_bias, "attention_sinks": cfg.attention_sinks,
             "conv_bias": bool(getattr(cfg, "short_conv", None) and cfg.short_conv.bias),
             "global_v_proj": bool(getattr(cfg, "global_attention", None)) and not cfg.global_attention.k_eq_v,
             "ple": getattr(cfg, "per_layer_input_size", 0) > 0, "v_proj": not getattr(cfg, "attention_k_eq_v", False)}
    family = family_for(cfg.model_type)
    table = family.fused_weights if fused else family.weights
    # lfm2_moe: a dense stack only with its layers; Gemma 4: its stacks that hold a layer
    present = model_stacks(cfg) if family.short_conv or family.gemma4 else None
    return [r for r in table if (r.when is None or flags[r.when]) and (present is None or r.stack is None
                                                                        or r.stack in present)]
