"""PEFT's layout for LoRA on transformers 5's fused MoE experts (`target_parameters`, peft's `lora.ParamWrapper`).

transformers 5 keeps a MoE layer's experts as 3-D parameters gate_up_proj [E, 2F, D] and down_proj [E, D, F] (torch
[E, out, in]) of one module per layer, whose name depends on the family (`experts_module`, read off the family's
weight table, in-memory names):

    qwen3_moe, mixtral, qwen2_moe, gpt_oss, qwen3_5_moe   model.layers.{i}.mlp.experts
                                                          (qwen3_5_moe's ConditionalGeneration: model.language_model.)
    gemma4 (the MoE block beside the dense MLP)           model.layers.{i}.experts  (model.language_model. likewise)
    lfm2_moe (its sparse layers)                          model.layers.{i}.feed_forward.experts

(a hybrid's experts are in both of its stacks, one module name by HF layer index). PEFT 0.21 targets them with
`target_parameters: ["<module after layers.{i}.>.gate_up_proj", "<...>.down_proj"]` (`mlp.experts.gate_up_proj`,
`experts.gate_up_proj`, `feed_forward.experts.gate_up_proj`) and wraps each in a ParamWrapper holding one adapter
per expert, stacked into the rank axis of two Linears:

    lora_A.weight  [E*R, in]    row e*R + j      = expert e's A row j           (expert-major)
    lora_B.weight  [out, R*E]   column j*E + e   = expert e's B column j        (rank-major, expert-minor)
    delta W[e] [out, in] = scaling * B_e [out, R] @ A_e [R, in],  scaling = alpha / r (r per expert, not E*R)

This is exactly our per-expert LoRA (each expert its own rank-R pair, one alpha / r), so every expert adapter of
every family is written and read exactly; nothing is approximated. PEFT adds the delta to the parameter itself
(torch.nn.utils.parametrize), so whatever the experts' forward does with W[e] it does with W[e] + delta W[e]:
transformers' x @ W[e].T is our x @ (kernel[e] + A[e] @ B[e] * scaling).

Two targeted parameters of one module are NESTED wrappers, in the module's parameter order (gate_up_proj, then
down_proj; the first wrapped is the innermost), so the saved names differ by `.base_layer` segments:

    base_model.model.model.layers.{i}.mlp.experts.base_layer.lora_A.weight    gate_up_proj (when both are targeted)
    base_model.model.model.layers.{i}.mlp.experts.lora_A.weight               down_proj (or the only target)

Ours: A [L, E, in, R], B [L, E, R, out] (`x @ A[e] @ B[e]`), so per layer A_pt = A.transpose(0, 2, 1).reshape(E*R,
in) and B_pt = B.transpose(2, 1, 0).reshape(out, R*E). PEFT forbids dropout, DoRA, bias and fan_in_fan_out on
these wrappers.

gpt_oss stores its experts `x @ W`-ready: gate_up_proj [E, D, 2F] (gate / up interleaved on the last axis) and
down_proj [E, F, D]; its experts module says `is_transposed = True`, so ParamWrapper reads in, out = shape[1:] and
does not swap them. The saved tensors are then the same lora_A [E*R, in] / lora_B [out, R*E] (delta einsum
"o r e, e r i -> e i o", added to the [E, in, out] parameter as is), and the interleaved 2F axis is lora_B's `out`
in both, exactly as our kernel [E, D, 2F] keeps it: one layout for every family (checked against peft in
tests/peft/test_router_adapter.py; Gemma 4's and LFM2-MoE's in tests/peft/test_moe_family_lora.py).
"""
from __future__ import annotations

import numpy as np

from surojax.models.registry import EXPERT_MODULES, FAMILIES, WeightRow

# target name -> the parameter's name in the HF experts module, in the module's parameter order (PEFT's nesting)
PEFT_PARAMETERS: dict[str, str] = {t: t.removeprefix("experts.") for t in EXPERT_MODULES}
# a published per-expert tensor name -> transformers 5's fused in-memory name (the same Decoder path), where a family
# keeps both tables: PEFT sees the in-memory modules (mixtral's `block_sparse_moe.experts.{e}.w2` is `mlp.experts`)
_IN_MEMORY: dict[str, str] = {
    r.hf: fused.hf for f in FAMILIES.values() for r in f.weights for fused in f.fused_weights
    if r.per_expert and fused.path == r.path and not fused.per_expert}


def experts_modules(rows: tuple[WeightRow, ...]) -> dict[str, str]:
    """Layer stack -> the HF module that holds its experts' fused parameters in memory ("{i}" for the layer), for
    every stack whose rows have experts: `model.layers.{i}.mlp.experts`, Gemma 4's `model.layers.{i}.experts`,
    LFM2-MoE's `model.layers.{i}.feed_forward.experts` (read off the row of the experts' down_proj)."""
    out = {}
    for r in rows:
        if r.per_layer and r.path.endswith("experts.down_proj.kernel"):
            hf = _IN_MEMORY.get(r.hf, r.hf)
            out.setdefault(r.stack, hf.split(".experts.", 1)[0] + ".experts")
    return out


def target_parameter(target: str, module: str) -> str:
    """PEFT's `target_parameters` entry for an expert target of the experts `module`: its name after `layers.{i}.`
    (mlp.experts.gate_up_proj, experts.gate_up_proj, feed_forward.experts.gate_up_proj)."""
    return f"{module.split('{i}.', 1)[1]}.{PEFT_PARAMETERS[target]}"


def matches_parameter(entry: str, target: str, module: str) -> bool:
    """Whether a `target_parameters` entry selects `target`'s parameter of the experts `module` as PEFT matches it:
    the parameter's whole name or its end after a dot (the layer index left out, as PEFT's own entries are)."""
    full = f"{module}.{PEFT_PARAMETERS[target]}"
    return full == entry or full.endswith("." + entry)


def expert_module_name(target: str, targets: tuple[str, ...], module: str) -> str:
    """The module path ("{i}" for the layer) PEFT saves `target`'s tensors under, given all expert targets (target
    names, not site keys) and the experts `module` (`experts_modules`)."""
    ordered = [t for t in PEFT_PARAMETERS if t in targets]
    depth = len(ordered) - 1 - ordered.index(target)  # wrappers nested outside this one
    return module + ".base_layer" * depth


def to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer: A [E, in, R], B [E, R, out] -> PEFT's lora_A [E*R, in], lora_B [out, R*E]."""
    E, d_in, R = a.shape
    d_out = b.shape[-1]
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(E * R, d_in)),
            np.ascontiguousarray(b.transpose(2, 1, 0).reshape(d_out, R * E)))


def from_peft(a_pt: np.ndarray, b_pt: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer: PEFT's lora_A [E*R, in], lora_B [out, R*E] -> A [E, in, R], B [E, R, out]."""
    E = a_pt.shape[0] // rank
    a = a_pt.reshape(E, rank, a_pt.shape[1]).transpose(0, 2, 1)
    b = b_pt.reshape(b_pt.shape[0], rank, E).transpose(2, 1, 0)
    return a, b
