"""LoRA on a vision-language model's tower (`Decoder.visual`, models/vision/): `train_vision: true` with `lora: true`.

    targets    every Linear of the tower (`tower_linears`): each block's attn.qkv, attn.proj, mlp.linear_fc1,
               mlp.linear_fc2, the merger's linear_fc1 / linear_fc2 and each deepstack merger's; not the patch
               embedding (a Conv3d in transformers, which our adapter files do not describe) nor the position table
    adapters   the language model's `LoRALinear` around each, unstacked: A [in, R], B [R, out] (the tower's blocks
               are separate modules, not a scanned stack), a dropout key of its own; the run's rank, alpha, rsLoRA,
               dropout and dtype (one PEFT adapter has one setting)
    PEFT       `base_model.model.model.visual.<path>.lora_A.weight` [R, in] / `lora_B.weight` [out, R], the names
               peft gives Qwen3VLForConditionalGeneration / Qwen3_5ForConditionalGeneration's `model.visual.*`;
               `target_modules` entries: `peft_vision_entries`

Paths are the tower's module paths, which are transformers' names under `model.visual.` (hf_weights.py), e.g.
`blocks.3.attn.qkv`, `merger.linear_fc2`, `deepstack_merger_list.0.linear_fc1`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear
from surojax.models.layers.params import AXES, logical_axes
from surojax.peft.lora import LoRADropoutKey, LoRALinear, tower_parent, vision_lora_modules

PATCH_EMBED = "patch_embed.proj"
# target_modules entries that name the whole tower's Linears (peft matches a module by its name's end): what we
# write when every tower Linear carries an adapter. The language models' modules end otherwise (q_proj ... down_proj,
# a hybrid's in_proj_* / out_proj, self_attn.*), so these reach the tower only.
TOWER_ENTRIES = ("attn.qkv", "attn.proj", "linear_fc1", "linear_fc2")
# the tower's module names with every layer index 0 (`is_vision_entry`)
_TEMPLATES = tuple("model.visual." + p for p in (
    "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.linear_fc1", "blocks.0.mlp.linear_fc2", "merger.linear_fc1",
    "merger.linear_fc2", "deepstack_merger_list.0.linear_fc1", "deepstack_merger_list.0.linear_fc2", PATCH_EMBED))


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def tower_linears(model) -> dict[str, Linear]:
    """The tower's LoRA targets: path -> its plain Linear (under an adapter: the adapter's base); {} without a tower."""
    tower = getattr(model, "visual", None)
    if tower is None:
        return {}
    out = {}
    for path, module in nnx.iter_modules(tower):
        name = _path(path)
        if type(module) is Linear and name != PATCH_EMBED and not name.endswith(".base"):
            out[name] = module
        elif isinstance(module, LoRALinear):
            out[name] = module.base
    return out


def tower_dims(model) -> dict[str, tuple[int, int]] | None:
    """path -> (in, out) of each tower Linear an adapter may hold; None for a model without a tower."""
    if getattr(model, "visual", None) is None:
        return None
    return {p: (m.in_features, m.out_features) for p, m in tower_linears(model).items()}


def apply_vision_lora(model, *, rank: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                      rngs: nnx.Rngs, dtype=jnp.float32, paths: Iterable[str] | None = None):
    """Wrap the tower's Linears (`paths`, default every one: `tower_linears`) in LoRALinears, initialised as PEFT's
    (A kaiming-uniform, B = 0: the model's output is unchanged). In place; returns the model."""
    linears = tower_linears(model)
    if not linears:
        raise ValueError(f"{model.cfg.model_type}: LoRA on the vision tower needs a model with one (model.visual)")
    paths = list(linears) if paths is None else list(paths)
    unknown = [p for p in paths if p not in linears]
    if unknown:
        raise ValueError(f"the vision tower has no Linear at {', '.join(unknown)} (its LoRA targets: "
                         f"{', '.join(linears)})")
    existing = vision_lora_modules(model)
    if existing:
        raise ValueError(f"the vision tower already has LoRA adapters on {', '.join(existing)}")
    for path in paths:
        base = linears[path]
        d_in, d_out = base.in_features, base.out_features
        in_axis, out_axis = logical_axes(base.kernel)
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)) on torch's [R, in], as lora.apply_lora
        a = jax.random.uniform(rngs.params(), (d_in, rank), jnp.float32, -bound, bound).astype(dtype)
        lora_a = nnx.LoRAParam(a, **{AXES: (in_axis, None)})
        lora_b = nnx.LoRAParam(jnp.zeros((rank, d_out), dtype), **{AXES: (None, out_axis)})
        key = None
        if dropout > 0.0:
            data = jax.random.key_data(rngs.params())
            key = LoRADropoutKey(data, **{AXES: (None,) * data.ndim})
        parent, leaf = tower_parent(model.visual, path)
        setattr(parent, leaf, LoRALinear(base, lora_a, lora_b, rank=rank, alpha=alpha, use_rslora=use_rslora,
                                         dropout=dropout, dropout_key=key))
    return model


def is_vision_entry(entry: str) -> bool:
    """Whether a peft `target_modules` entry names tower modules (matched as peft matches: a module's whole name or
    its end after a dot; layer indices compared as 0)."""
    e = re.sub(r"(?<![^.])\d+(?![^.])", "0", entry)  # a layer index: a whole dot-separated part
    return any(t == e or t.endswith("." + e) for t in _TEMPLATES)


def peft_vision_entries(paths: Iterable[str], all_paths: Iterable[str]) -> list[str]:
    """`target_modules` entries that select exactly the tower modules `paths`: TOWER_ENTRIES when they are all of
    the tower's Linears (`all_paths`), else each module's full name (`model.visual.<path>`)."""
    paths = list(paths)
    if set(paths) == set(all_paths):
        return list(TOWER_ENTRIES)
    return ["model.visual." + p for p in paths]


def matched_paths(entries: Iterable[str], all_paths: Iterable[str]) -> list[str]:
    """The tower modules among `all_paths` (and the patch embedding) that peft would wrap for `entries`."""
    names = [*all_paths, PATCH_EMBED]
    return [p for p in names if any(("model.visual." + p) == e or ("model.visual." + p).endswith("." + e)
                                    for e in entries)]
