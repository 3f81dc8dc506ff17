"""PEFT's layout for LoRA on transformers 5's fused MoE experts (`target_parameters`, peft's `lora.ParamWrapper`).

transformers 5 keeps a MoE layer's experts as 3-D parameters of one module `model.layers.{i}.mlp.experts`
(`model.language_model.layers.{i}.mlp.experts` in qwen3_5_moe's ConditionalGeneration model; a hybrid's experts are
in both of its stacks, one module name by HF layer index):
gate_up_proj [E, 2F, D] and down_proj [E, D, F] (torch [E, out, in]). PEFT 0.21 targets them with
`target_parameters: ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]` and wraps each in a ParamWrapper holding
one adapter per expert, stacked into the rank axis of two Linears:

    lora_A.weight  [E*R, in]    row e*R + j      = expert e's A row j           (expert-major)
    lora_B.weight  [out, R*E]   column j*E + e   = expert e's B column j        (rank-major, expert-minor)
    delta W[e] [out, in] = scaling * B_e [out, R] @ A_e [R, in],  scaling = alpha / r (r per expert, not E*R)

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
tests/peft/test_router_adapter.py).
"""
from __future__ import annotations

import numpy as np

from surojax.models.registry import EXPERT_MODULES

EXPERTS_MODULE = "layers.{i}.mlp.experts"  # the HF module that holds the fused expert parameters, after the
# family's layer prefix (`model.`; `model.language_model.` for a ConditionalGeneration model's text backbone)
# target name -> the PEFT target_parameters entry; also the parameters' order inside the module
PEFT_PARAMETERS: dict[str, str] = dict(EXPERT_MODULES)


def expert_module_name(target: str, targets: tuple[str, ...], prefix: str = "model.") -> str:
    """The module path ("{i}" for the layer) PEFT saves `target`'s tensors under, given all expert targets (target
    names, not site keys) and the family's layer prefix."""
    ordered = [t for t in PEFT_PARAMETERS if t in targets]
    depth = len(ordered) - 1 - ordered.index(target)  # wrappers nested outside this one
    return prefix + EXPERTS_MODULE + ".base_layer" * depth


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
