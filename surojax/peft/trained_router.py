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
The merged model (`merge_adapter`) carries them as ordinary weights.

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

from surojax.models.registry import WeightRow, weight_rows
from surojax.peft.peft_io import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE
from surojax.weights.atomic import write_text_atomic
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

ROUTER_PATHS = ("layers.mlp.router.kernel", "layers.mlp.router.bias")  # the Decoder state paths of the router


class RouterParam(nnx.LoRAParam):
    """A router weight that trains with the LoRA adapter (see the module docstring)."""


def make_router_trainable(model, dtype) -> int:
    """Re-type every router weight of `model` (a MoE Decoder) as a `RouterParam` in `dtype`, in place.
    Returns how many values now train. Raises ValueError for a dense model (no router)."""
    if model.cfg.moe is None:
        raise ValueError(f"train_router: {model.cfg.model_type} is a dense model; it has no router to train")
    router = model.layers.mlp.router
    n = 0
    for name in ("kernel", "bias"):
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
    transformers 5's in-memory model (the family's fused table where it has one). Empty for a dense model."""
    if cfg.moe is None:
        return ()
    rows = tuple(r for r in (weight_rows(cfg, fused=True) or weight_rows(cfg)) if r.path in ROUTER_PATHS)
    if not rows:
        raise ValueError(f"{cfg.model_type}: the weight table has no router row")
    return rows


def router_rows(model) -> tuple[WeightRow, ...]:
    """`peft_router_rows` of a MoE model; a dense model is an error."""
    if model.cfg.moe is None:
        raise ValueError(f"{model.cfg.model_type} is a dense model; it has no router")
    return peft_router_rows(model.cfg)


def set_router(model, router: dict[str, np.ndarray], *, trainable: bool, dtype) -> None:
    """Put saved router weights into `model` (in place). router: Decoder path (ROUTER_PATHS) -> value in our layout
    (kernel [L, D, E], bias [L, E]); every router weight of the model must be given, with the model's shape.
    trainable: each becomes a `RouterParam` in `dtype` (it trains with the adapter, as `make_router_trainable`);
    otherwise the value replaces the weight's, as a plain `nnx.Param` in the weight's own dtype."""
    if model.cfg.moe is None:
        raise ValueError(f"{model.cfg.model_type} is a dense model; it has no router to load")
    module = model.layers.mlp.router
    want = {p for p in ROUTER_PATHS if getattr(module, p.rsplit(".", 1)[1]) is not None}
    if set(router) != want:
        raise ValueError(f"router weights {sorted(router)} do not match the model's router {sorted(want)}")
    for path, value in router.items():
        name = path.rsplit(".", 1)[1]
        var = getattr(module, name)
        old = var.get_value()
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"router {name}: saved shape {list(value.shape)}, the model has {list(old.shape)}")
        kind = RouterParam if trainable else nnx.Param
        new = jnp.asarray(value, dtype if trainable else old.dtype)
        setattr(module, name, kind(new, **var.get_metadata()))


def router_tensors(model, dtype=None) -> dict[str, np.ndarray]:
    """The routers' weights under PEFT's saved names, one tensor per layer, in torch layout."""
    out = {}
    for row in router_rows(model):
        name = row.path.rsplit(".", 1)[1]
        value = np.asarray(jax.device_get(getattr(model.layers.mlp.router, name).get_value()))  # [L, D, E] | [L, E]
        if dtype is not None:
            value = value.astype(np.dtype(dtype))
        for i in range(value.shape[0]):
            w = value[i].T if row.transpose else value[i]
            out[PEFT_PREFIX + row.hf.format(i=i)] = np.ascontiguousarray(w)
    return out


def modules_to_save(model) -> list[str]:
    """PEFT's `modules_to_save` entry: the last name of the router module (`gate`, or `router` for gpt_oss)."""
    module = router_rows(model)[0].hf.format(i=0).rsplit(".", 1)[0]  # model.layers.0.mlp.gate
    return [module.rsplit(".", 1)[1]]


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
