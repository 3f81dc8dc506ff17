"""The Linear projections transforms act on, named once: LoRA, QLoRA's quantised base, FP8 / NVFP4 swaps and the
serving path all find a model's targets here.

    model_targets(model)             ("q_proj", ..., "down_proj") on a dense model; attention + the experts on MoE
                                     (+ the shared expert's three projections where the model has one)
    resolve_targets("all-linear", moe=False)   a user's names (or "all-linear") -> target names, checked
    resolve_model_targets(model, targets)   the same for this model: its site keys (MoE / shared expert / hybrid)
    module_at(model.layers, TARGET_PATHS["q_proj"])     the module at a target's path ("attn.q_proj")
    replace_module(model.layers, path, new)             put a module there (a wrapper around the old one)
    base_linear(model, "q_proj")     the Linear / ExpertLinear itself, through any wrapper around it

Target names: on a dense model the seven HF module names of registry.LINEAR_MODULES; on a MoE model q/k/v/o_proj
and the experts' fused projections, called `experts.gate_up_proj` / `experts.down_proj` (registry.EXPERT_MODULES);
a MoE model with a shared expert (qwen2_moe) also `shared_expert.gate_proj` / `.up_proj` / `.down_proj`
(registry.SHARED_EXPERT_MODULES: plain Linears, PEFT's `target_modules` names). The shared expert's sigmoid gate
(Linear(D, 1)) is not a target: it is trained by a full fine-tune only. On
a hybrid (Qwen3.5) also the Gated DeltaNet projections in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj
(registry.LINEAR_ATTENTION_MODULES); a MoE hybrid (qwen3_5_moe) has the MoE names (attention, experts, shared
expert) and the DeltaNet's. LFM2 (its `conv_layers` of short convolutions): the dense names (its attention's
out_proj is `o_proj`, its MLP's w1 / w3 / w2 gate_proj / up_proj / down_proj) and conv.in_proj / conv.out_proj
(registry.SHORT_CONV_MODULES); its HF spellings are accepted (CONV_SPELLINGS). LFM2-MoE: the MoE names (attention,
experts.gate_up_proj / experts.down_proj in both stacks) and the short conv's.

Sites. A target lives in one or more layer stacks (a hybrid's MLP projections in both `layers` and `linear_layers`,
its attention projections in `layers`, its DeltaNet projections in `linear_layers`). Each (stack, target) is a
site, keyed by the target name in `layers` (so every one-stack model's keys are its target names) and by
"stack.target" in another stack ("linear_layers.in_proj_qkv"): `model_targets` lists a model's site keys,
`site(model, key)` gives the stack module and the path inside it, `target_name(key)` the HF name back.
A transform that wraps a target's Linear (LoRA, an FP8 swap) keeps the wrapped module as its `base` attribute:
`base_linear` unwraps any such chain, so a transform applied later (quantising the base under LoRA) finds the
weights without knowing which wrappers came first.
"""
from __future__ import annotations

from collections.abc import Iterable

from flax import nnx

from surojax.models.registry import (EXPERT_MODULES, GEMMA4_STACKS, LINEAR_ATTENTION_MODULES, LINEAR_MODULES,
                                     SHARED_EXPERT_MODULES, SHORT_CONV_MODULES)

LORA_TARGETS: tuple[str, ...] = tuple(LINEAR_MODULES)  # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
EXPERT_TARGETS: tuple[str, ...] = tuple(EXPERT_MODULES)  # experts.gate_up_proj experts.down_proj
SHARED_EXPERT_TARGETS: tuple[str, ...] = tuple(SHARED_EXPERT_MODULES)  # shared_expert.gate_proj / up_proj / down_proj
LINEAR_ATTENTION_TARGETS: tuple[str, ...] = tuple(LINEAR_ATTENTION_MODULES)  # in_proj_qkv ... out_proj
HYBRID_TARGETS: tuple[str, ...] = LORA_TARGETS + LINEAR_ATTENTION_TARGETS  # what a dense hybrid has, in order
SHORT_CONV_TARGETS: tuple[str, ...] = tuple(SHORT_CONV_MODULES)  # conv.in_proj conv.out_proj (LFM2)
CONV_HYBRID_TARGETS: tuple[str, ...] = LORA_TARGETS + SHORT_CONV_TARGETS  # what LFM2 has, in order
# LFM2's HF module names (what its PEFT configs list) -> our target names
CONV_SPELLINGS: dict[str, tuple[str, ...]] = {
    "w1": ("gate_proj",), "w3": ("up_proj",), "w2": ("down_proj",), "in_proj": ("conv.in_proj",),
    "out_proj": ("o_proj", "conv.out_proj"), "self_attn.out_proj": ("o_proj",)}
# every target name -> its path inside a stack's block ("attn.q_proj", "linear_attn.in_proj_qkv")
TARGET_PATHS: dict[str, str] = {**LINEAR_MODULES, **EXPERT_MODULES, **SHARED_EXPERT_MODULES,
                                **LINEAR_ATTENTION_MODULES, **SHORT_CONV_MODULES}
ATTENTION_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_TARGETS: tuple[str, ...] = ATTENTION_TARGETS + EXPERT_TARGETS  # what a MoE model has, in order

# user-facing names on a MoE model -> our expert target names
_MOE_SPELLINGS = {"gate_up_proj": ("experts.gate_up_proj",), "down_proj": ("experts.down_proj",),
                  "experts": EXPERT_TARGETS, "shared_expert": SHARED_EXPERT_TARGETS,
                  **{t: (t,) for t in ATTENTION_TARGETS + EXPERT_TARGETS + SHARED_EXPERT_TARGETS
                     + LINEAR_ATTENTION_TARGETS}}


def resolve_targets(targets: str | Iterable[str], *, moe: bool = False, shared_expert: bool = False,
                    hybrid: bool = False, conv: bool = False, dense: bool = False) -> tuple[str, ...]:
    """User target names (or "all-linear") -> our target names in TARGET_PATHS order, checked.

    Dense model (moe=False): HF module names of LINEAR_MODULES. MoE model (moe=True): q/k/v/o_proj; the experts'
    `gate_up_proj` (also spelled `gate_proj` + `up_proj`, which must come together: one fused weight),
    `down_proj`, `experts` (both), or our names experts.gate_up_proj / experts.down_proj. With a shared expert
    (shared_expert=True) also `shared_expert` (its three projections) or shared_expert.gate_proj / .up_proj /
    .down_proj one by one; "all-linear" includes them. Hybrid (hybrid=True): also the Gated DeltaNet's
    projections (a dense hybrid: HYBRID_TARGETS; a MoE hybrid: the MoE names, then the DeltaNet's). LFM2 (conv=True,
    dense): the dense names and the short conv's conv.in_proj / conv.out_proj (CONV_HYBRID_TARGETS), also spelled
    as its HF modules (CONV_SPELLINGS: w1 / w3 / w2 the MLP's gate / up / down, in_proj, out_proj = the attention's
    and the conv's). LFM2-MoE (conv=True, moe=True): the attention, the experts (experts.gate_up_proj /
    experts.down_proj, `experts`, gate_up_proj) and the conv's; with dense leading layers (dense=True) also their
    MLP's gate_proj / up_proj / down_proj (w1 / w3 / w2)."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    if conv and not moe:
        if targets == ["all-linear"]:
            return CONV_HYBRID_TARGETS
        unknown = [t for t in targets if t not in CONV_HYBRID_TARGETS and t not in CONV_SPELLINGS]
        if unknown or not targets:
            raise ValueError(f"LoRA target modules {unknown or targets!r} are not valid; choose from "
                             f"{', '.join(CONV_HYBRID_TARGETS)}, LFM2's names {', '.join(CONV_SPELLINGS)} or "
                             "'all-linear'")
        chosen = {n for t in targets for n in CONV_SPELLINGS.get(t, (t,))}
        return tuple(t for t in CONV_HYBRID_TARGETS if t in chosen)
    if conv:  # lfm2_moe: the attention, (the dense layers' MLP), the experts, the short conv
        available = lfm2_moe_targets(dense)
        if targets == ["all-linear"]:
            return available
        spell = {"gate_up_proj": ("experts.gate_up_proj",), "experts": EXPERT_TARGETS,
                 **{t: (t,) for t in available}, **CONV_SPELLINGS}
        unknown = [t for t in targets if t not in spell or any(n not in available for n in spell[t])]
        if unknown or not targets:
            raise ValueError(f"LoRA target modules {unknown or targets!r} are not valid on lfm2_moe; choose from "
                             f"{', '.join(available)}, gate_up_proj, experts (both expert projections), LFM2's "
                             f"names {', '.join(n for n in CONV_SPELLINGS if all(t in available for t in CONV_SPELLINGS[n]))} "
                             "or 'all-linear'")
        chosen = {n for t in targets for n in spell[t]}
        return tuple(t for t in available if t in chosen)
    if not moe:
        available = HYBRID_TARGETS if hybrid else LORA_TARGETS
        if targets == ["all-linear"]:
            return available
        unknown = [t for t in targets if t not in available]
        if unknown or not targets:
            raise ValueError(f"LoRA target modules {unknown or targets!r} are not valid; choose from "
                             f"{', '.join(available)} or 'all-linear'")
        return tuple(t for t in available if t in targets)
    available = _moe_names(shared_expert, hybrid)
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
        linear = f", {', '.join(LINEAR_ATTENTION_TARGETS)}" if hybrid else ""
        raise ValueError(f"LoRA target modules {unknown or targets!r} are not valid on a MoE model; choose from "
                         f"{', '.join(ATTENTION_TARGETS)}, gate_up_proj (= gate_proj + up_proj), down_proj, "
                         f"experts (both expert projections){shared}{linear} or 'all-linear'")
    chosen = {t for n in names for t in _MOE_SPELLINGS[n]}
    return tuple(t for t in available if t in chosen)


def resolve_moe_block_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """Gemma 4 with its MoE block: the dense names (LORA_TARGETS: gate_proj / up_proj / down_proj are the dense MLP's)
    and the experts' fused projections (experts.gate_up_proj / experts.down_proj, `experts` both, `gate_up_proj`)."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    available = LORA_TARGETS + EXPERT_TARGETS
    if targets == ["all-linear"]:
        return available
    spell = {**{t: (t,) for t in available}, "experts": EXPERT_TARGETS, "gate_up_proj": ("experts.gate_up_proj",)}
    unknown = [t for t in targets if t not in spell]
    if unknown or not targets:
        raise ValueError(f"LoRA target modules {unknown or targets!r} are not valid on Gemma 4 with its MoE block; "
                         f"choose from {', '.join(available)}, experts (both expert projections), gate_up_proj or "
                         "'all-linear'")
    chosen = {n for t in targets for n in spell[t]}
    return tuple(t for t in available if t in chosen)


def lfm2_moe_targets(dense: bool) -> tuple[str, ...]:
    """LFM2-MoE's target names in order: attention, the dense leading layers' MLP (with `dense`), experts, conv."""
    return ATTENTION_TARGETS + (LORA_TARGETS[4:] if dense else ()) + EXPERT_TARGETS + SHORT_CONV_TARGETS


def _moe_names(shared_expert: bool, hybrid: bool) -> tuple[str, ...]:
    """A MoE model's target names in order: attention, experts, the shared expert's, a hybrid's DeltaNet's."""
    return (MOE_TARGETS + (SHARED_EXPERT_TARGETS if shared_expert else ())
            + (LINEAR_ATTENTION_TARGETS if hybrid else ()))


def has_moe_block(model) -> bool:
    """Gemma 4's MoE block beside the dense MLP (its experts are targets beside the dense names)."""
    return bool(getattr(model.cfg, "moe_beside_mlp", False))


def is_moe(model) -> bool:
    """The model's MLPs are MoEs (Gemma 4's MoE block beside a dense MLP is not: its targets are the dense names)."""
    return model.cfg.moe is not None and not getattr(model.cfg, "moe_beside_mlp", False)


def has_shared_expert(model) -> bool:
    return is_moe(model) and model.cfg.moe.shared_expert_intermediate_size > 0




def is_hybrid(model) -> bool:
    return model.cfg.linear_attention is not None


def _has_dense_layers(model) -> bool:
    """lfm2_moe with dense leading layers (their own stacks, with the dense MLP)."""
    return bool(getattr(model.cfg, "dense_layers", 0))


def has_short_conv(model) -> bool:
    return getattr(model.cfg, "short_conv", None) is not None


def has_global_layers(model) -> bool:
    """Gemma 4 with layers outside `layers`: full-attention layers of their own shape (`global_layers`), KV-shared
    layers (`shared_layers` / `shared_global_layers`)."""
    return any(name in stacks(model) for name in GEMMA4_STACKS[1:])


def _multi_stack(model) -> bool:
    """The targets live in several stacks (site keys "stack.target"): a Qwen3.5 hybrid, LFM2, Gemma 4's
    `global_layers` (its full layers; no v_proj under attention_k_eq_v) and KV-shared stacks (no k_proj / v_proj)."""
    return is_hybrid(model) or has_short_conv(model) or has_global_layers(model)


def stacks(model) -> dict[str, nnx.Module]:
    """The model's layer stacks by name (`Decoder.stacks`; a model without the property: its `layers`)."""
    return dict(getattr(model, "stacks", None) or {"layers": model.layers})


def site_key(stack: str, target: str) -> str:
    return target if stack == "layers" else f"{stack}.{target}"


def target_name(key: str) -> str:
    """The HF target name of a site key ("linear_layers.gate_proj" -> "gate_proj")."""
    return key if key in TARGET_PATHS else key.split(".", 1)[1]


def site_stack(key: str) -> str:
    """The stack of a site key ("linear_layers.gate_proj" -> "linear_layers", "q_proj" -> "layers")."""
    return "layers" if key in TARGET_PATHS else key.split(".", 1)[0]


def site(model, key: str) -> tuple[nnx.Module, str]:
    """(the stack module, the target's path in it) of a site key."""
    root = stacks(model)[site_stack(key)]
    return root, target_path(root, target_name(key))


def target_path(root: nnx.Module, name: str) -> str:
    """Target `name`'s path inside a stack's blocks: TARGET_PATHS, except Gemma 4's experts, which sit in the MoE
    block beside the MLP (`moe.experts.*`, not `mlp.experts.*`)."""
    path = TARGET_PATHS[name]
    if name in EXPERT_TARGETS and getattr(root, "moe", None) is not None:
        return "moe." + path.removeprefix("mlp.")
    return path


def target_sites(model, names: Iterable[str]) -> tuple[str, ...]:
    """The site keys of target `names` on this model: each name in every stack whose blocks have that module."""
    out = []
    for stack, root in stacks(model).items():
        for name in names:
            parent, _, leaf = target_path(root, name).rpartition(".")
            holder = root
            for part in parent.split(".") if parent else ():  # None where the stack's blocks lack the path
                holder = getattr(holder, part, None)
            if parent and holder is not None and getattr(holder, leaf, None) is not None:
                out.append(site_key(stack, name))
    return tuple(out)


def model_targets(model) -> tuple[str, ...]:
    """The target site keys this model has (dense: LORA_TARGETS; MoE: MOE_TARGETS, + SHARED_EXPERT_TARGETS with a
    shared expert; a hybrid: those and LINEAR_ATTENTION_TARGETS in each stack that has them, `layers` first)."""
    if has_short_conv(model):
        return target_sites(model, lfm2_moe_targets(_has_dense_layers(model)) if is_moe(model)
                            else CONV_HYBRID_TARGETS)
    if has_moe_block(model):
        names = LORA_TARGETS + EXPERT_TARGETS
        return target_sites(model, names) if has_global_layers(model) else names
    if has_global_layers(model):
        return target_sites(model, LORA_TARGETS)
    if not is_moe(model):
        return target_sites(model, HYBRID_TARGETS) if is_hybrid(model) else LORA_TARGETS
    names = _moe_names(has_shared_expert(model), is_hybrid(model))
    return target_sites(model, names) if is_hybrid(model) else names


def resolve_model_targets(model, targets: str | Iterable[str]) -> tuple[str, ...]:
    """A user's target names (or "all-linear") -> this model's site keys (`resolve_targets`, then `target_sites`
    on a hybrid; on a one-stack model the names themselves)."""
    if has_moe_block(model):
        names = resolve_moe_block_targets(targets)
        return target_sites(model, names) if has_global_layers(model) else names
    names = resolve_targets(targets, moe=is_moe(model), shared_expert=has_shared_expert(model),
                            hybrid=is_hybrid(model), conv=has_short_conv(model), dense=_has_dense_layers(model))
    return target_sites(model, names) if _multi_stack(model) else names


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
    """The base Linear (or ExpertLinear) of a target (a site key), through any wrapper that keeps it as `base`
    (LoRA, ...)."""
    mod = module_at(*site(model, target))
    while hasattr(mod, "base") and isinstance(mod.base, nnx.Module):
        mod = mod.base
    return mod
