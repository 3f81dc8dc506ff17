"""`train_router`: the full router weights of a MoE model train alongside a LoRA adapter.

The trainer selects what trains by variable type (surojax.peft.lora: TRAINABLE = nnx.LoRAParam), so the router
kernel [L, D, E] (and its bias [L, E] where the family has one) is re-typed as `RouterParam`, a subclass of
`nnx.LoRAParam`: it is trainable, left out of FROZEN, still an `nnx.Param` (so `nnx.state(model, nnx.Param)`,
the checkpoint saver and `merge_lora` see it as a weight of the model). It is stored in the adapter's dtype
(fp32 by default: a bf16 base's router would otherwise take bf16 AdamW updates).

Export: PEFT `modules_to_save` — the adapter folder gets the routers' full weights under the HF module name
(`base_model.model.model.layers.{i}.mlp.gate.weight`, torch layout [E, D]) and adapter_config.json lists the
module's last name (`gate`; `router` for gpt_oss), which `peft.PeftModel.from_pretrained` loads into its
`ModulesToSaveWrapper`. The names are transformers 5's in-memory module paths, which PEFT sees: Mixtral's router is
`mlp.gate` there (its checkpoints say `block_sparse_moe.gate`), so the family's fused table wins where it has one.
The merged model (`merge_adapter`) carries them as ordinary weights. A hybrid MoE (qwen3_5_moe) has a router in
each layer stack (`layers.mlp.router`, `linear_layers.mlp.router`): all of them train, and each stack's rows are
saved under their HF layer indices (registry.stack_layers), one module name for both.

Import: surojax.peft.peft_io reads such an adapter's router tensors (`PeftAdapter.router`, our layout) given
`peft_router_rows(cfg)`; `set_router` puts them into a model: a `RouterParam` when the adapter is loaded to keep
training, the model's own plain `nnx.Param` (in its dtype) when the adapter is folded in.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.registry import WeightRow, stack_layers, weight_rows
from surojax.models.targets import stacks
from surojax.peft.peft_io import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE
from surojax.weights.atomic import write_text_atomic
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

ROUTER_WEIGHTS = ("kernel", "bias")  # a router's weights: state path `{stack}.mlp.router.{name}`


def _routers(model) -> dict[str, nnx.Module]:
    """Each layer stack's router module, by stack name (lfm2_moe's dense leading stacks have none)."""
    return {name: stack.mlp.router for name, stack in stacks(model).items() if hasattr(stack.mlp, "router")}


def _is_router_path(path: str) -> bool:
    stack, _, rest = path.partition(".")
    return rest in tuple(f"mlp.router.{w}" for w in ROUTER_WEIGHTS)


class RouterParam(nnx.LoRAParam):
    """A router weight that trains with the LoRA adapter (see the module docstring)."""


def make_router_trainable(model, dtype) -> int:
    """Re-type every router weight of `model` (a MoE Decoder) as a `RouterParam` in `dtype`, in place.
    Returns how many values now train. Raises ValueError for a dense model (no router)."""
    if model.cfg.moe is None:
        raise ValueError(f"train_router: {model.cfg.model_type} is a dense model; it has no router to train")
    if getattr(model.cfg, "moe_beside_mlp", False):
        raise ValueError("train_router: Gemma 4's MoE-block router (its input scale and per-expert scales beside the "
                         "projection) is not supported yet; train without train_router")
    n = 0
    for router in _routers(model).values():
        for name in ROUTER_WEIGHTS:
            var = getattr(router, name)
            if var is None:
                continue
            setattr(router, name, RouterParam(var.get_value().astype(dtype), **var.get_metadata()))
            n += var.get_value().size
    return n


def has_trained_router(model) -> bool:
    return model.cfg.moe is not None and isinstance(model.layers.mlp.router.kernel, RouterParam)


def peft_router_rows(cfg) -> tuple[WeightRow, ...]:
    """The router's weight-table rows (kernel, and the bias where it exists) under the names PEFT saves: those of
    transformers 5's in-memory model (the family's fused table where it has one). Empty for a dense model, and for
    Gemma 4's MoE block, whose router does not train (make_router_trainable): an adapter that saved it is refused."""
    if cfg.moe is None or getattr(cfg, "moe_beside_mlp", False):
        return ()
    rows = tuple(r for r in (weight_rows(cfg, fused=True) or weight_rows(cfg)) if _is_router_path(r.path))
    if not rows:
        raise ValueError(f"{cfg.model_type}: the weight table has no router row")
    return rows


def router_rows(model) -> tuple[WeightRow, ...]:
    """`peft_router_rows` of a MoE model; a dense model is an error."""
    if model.cfg.moe is None:
        raise ValueError(f"{model.cfg.model_type} is a dense model; it has no router")
    return peft_router_rows(model.cfg)


def set_router(model, router: dict[str, np.ndarray], *, trainable: bool, dtype) -> None:
    """Put saved router weights into `model` (in place). router: Decoder path (`{stack}.mlp.router.kernel` /
    `.bias`) -> value in our layout (kernel [rows, D, E], bias [rows, E]); every router weight of the model must
    be given, with the model's shape.
    trainable: each becomes a `RouterParam` in `dtype` (it trains with the adapter, as `make_router_trainable`);
    otherwise the value replaces the weight's, as a plain `nnx.Param` in the weight's own dtype."""
    if model.cfg.moe is None:
        raise ValueError(f"{model.cfg.model_type} is a dense model; it has no router to load")
    routers = _routers(model)
    want = {f"{stack}.mlp.router.{w}" for stack, module in routers.items() for w in ROUTER_WEIGHTS
            if getattr(module, w) is not None}
    if set(router) != want:
        raise ValueError(f"router weights {sorted(router)} do not match the model's router {sorted(want)}")
    for path, value in router.items():
        stack, name = path.split(".", 1)[0], path.rsplit(".", 1)[1]
        module = routers[stack]
        var = getattr(module, name)
        old = var.get_value()
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"router {name}: saved shape {list(value.shape)}, the model has {list(old.shape)}")
        kind = RouterParam if trainable else nnx.Param
        new = jnp.asarray(value, dtype if trainable else old.dtype)
        setattr(module, name, kind(new, **var.get_metadata()))


def router_tensors(model, dtype=None) -> dict[str, np.ndarray]:
    """The routers' weights under PEFT's saved names, one tensor per layer, in torch layout."""
    out, routers = {}, _routers(model)
    for row in router_rows(model):
        name = row.path.rsplit(".", 1)[1]
        value = np.asarray(jax.device_get(getattr(routers[row.stack], name).get_value()))  # [rows, D, E] | [rows, E]
        if dtype is not None:
            value = value.astype(np.dtype(dtype))
        for r, i in enumerate(stack_layers(model.cfg, row.stack)):
            w = value[r].T if row.transpose else value[r]
            out[PEFT_PREFIX + row.hf.format(i=i)] = np.ascontiguousarray(w)
    return out


def modules_to_save(model) -> list[str]:
    """PEFT's `modules_to_save` entry: the router module's last name (`gate`, or `router` for gpt_oss), with its
    parent (`mlp.gate`) on a model with a shared expert: PEFT matches the end of a module's name as a string, and a
    bare `gate` would also wrap the shared expert's gate (`mlp.shared_expert_gate`)."""
    module = router_rows(model)[0].hf.format(i=0).rsplit(".", 1)[0]  # model.layers.0.mlp.gate
    parts = 2 if model.cfg.moe.shared_expert_intermediate_size else 1
    return [".".join(module.split(".")[-parts:])]


def add_router_to_adapter(model, adapter_dir: str | os.PathLike, dtype=None) -> None:
    """Write the trained routers into a saved PEFT adapter folder as `modules_to_save` (each file is rewritten
    under a temporary name and renamed into place)."""
    adapter_dir = Path(adapter_dir)
    weights = adapter_dir / WEIGHTS_FILE
    f = SafetensorsFile(weights)
    tensors = {n: np.asarray(f.get(n)) for n in f.names()}
    tensors.update(router_tensors(model, dtype))
    write_safetensors(weights, tensors, metadata={"format": "pt"})  # atomic: a temporary file renamed over it
    config_path = adapter_dir / CONFIG_FILE
    cfg = json.loads(config_path.read_text())
    cfg["modules_to_save"] = modules_to_save(model)
    write_text_atomic(config_path, json.dumps(cfg, indent=2) + "\n")
