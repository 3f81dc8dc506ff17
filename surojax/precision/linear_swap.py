"""What the low-precision recipes (fp8_hybrid, nvfp4) share as transforms on a built `Decoder`: which Linear
targets they swap, the per-layer masks of the layers kept in bf16, and the swap of a target's base Linear (the
`base` of a LoRALinear) for a recipe's own Linear.

Which targets. The model's target sites (surojax.models.targets.model_targets: one vocabulary with LoRA and
QLoRA) minus `KEPT_BF16`, so every layer stack is covered: on a dense model the seven q / k / v / o / gate / up /
down; on a hybrid (Qwen3.5) those in `layers` (gated attention + MLP) and in `linear_layers` the MLP's and the
Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj (site keys "linear_layers.in_proj_qkv", ...); on a MoE
model q / k / v / o and a shared expert's three projections. Kept in bf16 on every model, by name:
  in_proj_b, in_proj_a   the DeltaNet's beta and decay-rate projections: Hv outputs (16-64 at Qwen3.5's sizes),
                         ~Hv / (2 Hk Dk + 2 Hv Dv) of the layer's projection FLOPs (under 2 %), so an FP8 GEMM saves
                         nothing; and their outputs are gates (sigmoid -> beta, softplus -> the log-decay g)
                         whose error the recurrence compounds over every later token of the sequence
                         (llm-compressor's FP8 recipe for Qwen3.5 leaves the whole linear_attn in bf16)
  experts.gate_up_proj, experts.down_proj   a MoE layer's routed experts: ExpertLinear grouped GEMMs, which have
                         no FP8 / NVFP4 form here (the recipe's GEMMs are per-tensor Linear GEMMs)
Not targets at all, so bf16 too: the MoE router and a shared expert's sigmoid gate (Linear(D, 1)), the DeltaNet's
depthwise conv1d, embeddings, norms, the LM head.

Layers kept in bf16 (skip_quant_first_layers / skip_quant_last_layers, nvfp4's default rule) count HF layer
indices: `layer_mask` is over the model's L layers in HF order, and each stack takes its rows' entries
(registry.stack_layers: a stack row -> its HF layer index), so "the last 2 layers" are HF layers L-2 and L-1
whatever stack holds them. The stacked layers share one scan body, so a layer kept in bf16 cannot be a different
module: each swapped Linear of a stack that has bf16 rows holds an [rows] bool flag on the `layers` axis
(`QuantLayerMask`) and picks the low-precision or the bf16 matmul with `lax.cond`. A stack whose rows are all
kept in bf16 is not swapped.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.layers.linear import Linear
from surojax.models.layers.params import AXES
from surojax.models.registry import model_stacks, stack_layers
from surojax.models.targets import model_targets, module_at, replace_module, site, site_stack, target_name
from surojax.peft.lora import LoRALinear

# target name -> why a low-precision recipe leaves it in bf16 (module docstring)
KEPT_BF16: dict[str, str] = {
    "in_proj_b": "Hv outputs: no FP8 gain; its sigmoid gate (beta) feeds the recurrence",
    "in_proj_a": "Hv outputs: no FP8 gain; its decay rate (g) compounds over the sequence",
    "experts.gate_up_proj": "grouped expert GEMM: no FP8 / NVFP4 form",
    "experts.down_proj": "grouped expert GEMM: no FP8 / NVFP4 form",
}


class QuantLayerMask(nnx.Variable):
    """[rows] bool: True where the stack row's matmuls run in the recipe's low precision (False: kept in bf16)."""


def layer_mask(num_layers: int, skip_first: int, skip_last: int, precision: str) -> jax.Array | None:
    """[L] bool over the HF layers (False on the first / last skipped layers), or None when every layer runs in
    `precision`."""
    if skip_first < 0 or skip_last < 0 or skip_first + skip_last >= num_layers:
        raise ValueError(f"skip_quant_first_layers ({skip_first}) + skip_quant_last_layers ({skip_last}) must leave "
                         f"at least one of the model's {num_layers} layers in {precision}")
    if skip_first == 0 and skip_last == 0:
        return None
    index = jnp.arange(num_layers)
    return (index >= skip_first) & (index < num_layers - skip_last)


def stack_masks(cfg, skip_first: int, skip_last: int, precision: str) -> dict[str, np.ndarray | None]:
    """Per layer stack, its rows' entries of `layer_mask` over the HF layers ([rows] bool; None: every row runs in
    `precision`). A stack absent from the model (a one-stack model's `linear_layers`) is absent here."""
    hf = layer_mask(cfg.num_layers, skip_first, skip_last, precision)
    out = {}
    stacks = model_stacks(cfg)
    for stack in stacks:
        rows = np.asarray(stack_layers(cfg, stack), dtype=np.int64)
        m = None if hf is None else np.asarray(hf)[rows]
        out[stack] = None if m is None or m.all() else m
    return out


def quantised_sites(model) -> tuple[str, ...]:
    """The model's target site keys a low-precision recipe swaps: `model_targets` minus `KEPT_BF16`."""
    return tuple(k for k in model_targets(model) if target_name(k) not in KEPT_BF16)


def swap_base_linears(model, make: Callable[[str, Linear, int, QuantLayerMask | None], Linear], recipe: str, *,
                      skip_first: int, skip_last: int, precision: str) -> list[str]:
    """Replace the base Linear of every `quantised_sites` site by make(site key, linear, rows, mask) (in place;
    rows: the stack's layer count, mask: its `QuantLayerMask` or None); returns the site keys swapped (a stack
    whose rows are all kept in bf16 is left as it is). Raises ValueError for a Linear already swapped or a kernel
    that is already quantised (qlora_* bases)."""
    masks = stack_masks(model.cfg, skip_first, skip_last, precision)
    done = []
    for key in quantised_sites(model):
        stack = site_stack(key)
        mask = masks[stack]
        if mask is not None and not mask.any():
            continue
        root, path = site(model, key)
        mod = module_at(root, path)
        holder, lin = (mod, mod.base) if isinstance(mod, LoRALinear) else (None, mod)
        if type(lin) is not Linear:
            raise ValueError(f"{key}: a low-precision recipe is already applied ({type(lin).__name__})")
        if not isinstance(lin.kernel.get_value(), jax.Array):
            raise ValueError(f"{key}: kernel is already quantised ({type(lin.kernel.get_value()).__name__}); the "
                             f"{recipe} recipe needs a bf16 / fp32 base (remove the qlora_* key)")
        rows = len(stack_layers(model.cfg, stack))
        new = make(key, lin, rows, None if mask is None else QuantLayerMask(jnp.asarray(mask), **{AXES: ("layers",)}))
        if holder is not None:
            holder.base = new
        else:
            replace_module(root, path, new)
        done.append(key)
    return done


def kept_bf16_sites(model, swapped: list[str]) -> list[str]:
    """The model's target sites a recipe left in bf16 (KEPT_BF16, or a stack with no quantised row), for its log."""
    return [k for k in model_targets(model) if k not in swapped]


def swapped_linears(model, kind: type) -> dict[str, Linear]:
    """site key -> the recipe's Linear of class `kind` at that site (through a LoRA wrapper), in site order."""
    out = {}
    for key in quantised_sites(model):
        mod = module_at(*site(model, key))
        mod = mod.base if isinstance(mod, LoRALinear) else mod
        if isinstance(mod, kind):
            out[key] = mod
    return out


__all__ = ["KEPT_BF16", "QuantLayerMask", "kept_bf16_sites", "layer_mask", "quantised_sites", "stack_masks",
           "swap_base_linears", "swapped_linears"]
