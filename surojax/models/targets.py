"""The Linear projections transforms act on, named once: LoRA, QLoRA's quantised base, FP8 / NVFP4 swaps and the
serving path all find a model's targets here.

    model_targets(model)             ("q_proj", ..., "down_proj") on a dense model; attention + the experts on MoE
                                     (+ the shared expert's three projections where the model has one)
    resolve_targets("all-linear", moe=False)   a user's names (or "all-linear") -> target names, checked
    model_resolve(model, targets)    the same for this model (its MoE / shared-expert flags)
    module_at(model.layers, TARGET_PATHS["q_proj"])     the module at a target's path ("attn.q_proj")
    replace_module(model.layers, path, new)             put a module there (a wrapper around the old one)
    base_linear(model, "q_proj")     the Linear / ExpertLinear itself, through any wrapper around it

Target names: on a dense model the seven HF module names of registry.LINEAR_MODULES; on a MoE model q/k/v/o_proj
and the experts' fused projections, called `experts.gate_up_proj` / `experts.down_proj` (registry.EXPERT_MODULES);
a MoE model with a shared expert (qwen2_moe) also `shared_expert.gate_proj` / `.up_proj` / `.down_proj`
(registry.SHARED_EXPERT_MODULES: plain Linears, PEFT's `target_modules` names). The shared expert's sigmoid gate
(Linear(D, 1)) is not a target: it is trained by a full fine-tune only.
A transform that wraps a target's Linear (LoRA, an FP8 swap) keeps the wrapped module as its `base` attribute:
`base_linear` unwraps any such chain, so a transform applied later (quantising the base under LoRA) finds the
weights without knowing which wrappers came first.
"""
from __future__ import annotations

from collections.abc import Iterable

from flax import nnx

from surojax.models.registry import EXPERT_MODULES, LINEAR_MODULES, SHARED_EXPERT_MODULES

LORA_TARGETS: tuple[str, ...] = tuple(LINEAR_MODULES)  # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
EXPERT_TARGETS: tuple[str, ...] = tuple(EXPERT_MODULES)  # experts.gate_up_proj experts.down_proj
SHARED_EXPERT_TARGETS: tuple[str, ...] = tuple(SHARED_EXPERT_MODULES)  # shared_expert.gate_proj / up_proj / down_proj
# every target name -> its path in model.layers
TARGET_PATHS: dict[str, str] = {**LINEAR_MODULES, **EXPERT_MODULES, **SHARED_EXPERT_MODULES}
ATTENTION_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_TARGETS: tuple[str, ...] = ATTENTION_TARGETS + EXPERT_TARGETS  # what a MoE model has, in order

# user-facing names on a MoE model -> our expert target names
_MOE_SPELLINGS = {"gate_up_proj": ("experts.gate_up_proj",), "down_proj": ("experts.down_proj",),
                  "experts": EXPERT_TARGETS, "shared_expert": SHARED_EXPERT_TARGETS,
                  **{t: (t,) for t in ATTENTION_TARGETS + EXPERT_TARGETS + SHARED_EXPERT_TARGETS}}


def resolve_targets(targets: str | Iterable[str], *, moe: bool = False,
                    shared_expert: bool = False) -> tuple[str, ...]:
    """User target names (or "all-linear") -> our target names in TARGET_PATHS order, checked.

    Dense model (moe=False): HF module names of LINEAR_MODULES. MoE model (moe=True): q/k/v/o_proj; the experts'
    `gate_up_proj` (also spelled `gate_proj` + `up_proj`, which must come together: one fused weight),
    `down_proj`, `experts` (both), or our names experts.gate_up_proj / experts.down_proj. With a shared expert
    (shared_expert=True) also `shared_expert` (its three projections) or shared_expert.gate_proj / .up_proj /
    .down_proj one by one; "all-linear" includes them."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    if not moe:
        if targets == ["all-linear"]:
            return LORA_TARGETS
        unknown = [t for t in targets if t not in LINEAR_MODULES]
        if unknown or not targets:
            raise ValueError(f"LoRA target modules {unknown or targets!r} are not valid; choose from "
                             f"{', '.join(LORA_TARGETS)} or 'all-linear'")
        return tuple(t for t in LORA_TARGETS if t in targets)
    available = MOE_TARGETS + (SHARED_EXPERT_TARGETS if shared_expert else ())
    if targets == ["all-linear"]:
        return available
    names = set(targets)
    if ("gate_proj" in names) != ("up_proj" in names):
        raise ValueError("on a MoE model the experts' gate_proj and up_proj are one fused weight (gate_up_proj): "
                         "target both, or gate_up_proj, or neither")
    if "gate_proj" in names:
        names = (names - {"gate_proj", "up_proj"}) | {"gate_up_proj"}
    unknown = sorted(n for n in names if n not in _MOE_SPELLINGS
                     or any(t not in available for t in _MOE_SPELLINGS[n]))
    if unknown or not targets:
        shared = ""
        if shared_expert:
            shared = ", shared_expert (its three projections), " + ", ".join(SHARED_EXPERT_TARGETS)
        elif any(n.startswith("shared_expert") for n in names):
            shared = " (this model has no shared expert)"
        raise ValueError(f"LoRA target modules {unknown or targets!r} are not valid on a MoE model; choose from "
                         f"{', '.join(ATTENTION_TARGETS)}, gate_up_proj (= gate_proj + up_proj), down_proj, "
                         f"experts (both expert projections){shared} or 'all-linear'")
    chosen = {t for n in names for t in _MOE_SPELLINGS[n]}
    return tuple(t for t in available if t in chosen)


def is_moe(model) -> bool:
    return model.cfg.moe is not None


def has_shared_expert(model) -> bool:
    return is_moe(model) and model.cfg.moe.shared_expert_intermediate_size > 0


def model_targets(model) -> tuple[str, ...]:
    """The target names this model has (dense: LORA_TARGETS; MoE: MOE_TARGETS, + SHARED_EXPERT_TARGETS)."""
    if not is_moe(model):
        return LORA_TARGETS
    return MOE_TARGETS + (SHARED_EXPERT_TARGETS if has_shared_expert(model) else ())


def model_resolve(model, targets: str | Iterable[str]) -> tuple[str, ...]:
    """`resolve_targets` for this model: its MoE and shared-expert flags."""
    return resolve_targets(targets, moe=is_moe(model), shared_expert=has_shared_expert(model))


def module_at(root: nnx.Module, dotted: str):
    """The module at a dotted path under `root` (e.g. model.layers, "attn.q_proj")."""
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


def replace_module(root: nnx.Module, dotted: str, value) -> None:
    """Put `value` at a dotted path under `root` (the module there is replaced, e.g. by a wrapper around it)."""
    *parents, last = dotted.split(".")
    for part in parents:
        root = getattr(root, part)
    setattr(root, last, value)


def base_linear(model, target: str) -> nnx.Module:
    """The base Linear (or ExpertLinear) of a target, through any wrapper that keeps it as `base` (LoRA, ...)."""
    mod = module_at(model.layers, TARGET_PATHS[target])
    while hasattr(mod, "base") and isinstance(mod.base, nnx.Module):
        mod = mod.base
    return mod
