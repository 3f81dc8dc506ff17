"""Stacked LoRA: start a LoRA run from an existing PEFT adapter.

    adapter_init_mode: merge      fold the existing adapter into the base weights, then add a fresh trainable
                                  adapter on top (the old one is no longer a separate variable)
    adapter_init_mode: trainable  load the existing adapter as THE trainable adapter and continue it (its own
                                  rank, alpha, targets and rsLoRA flag; only dropout is a training setting)

Only one adapter is ever trainable; folding keeps the forward pass at one low-rank update per module.
A vision-language model's adapter may hold the tower's adapters too (`train_vision` with LoRA, peft/vision_lora.py):
they fold or continue with the rest; continuing needs `vision` to agree with the adapter (`init_lora`).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from surojax.models.registry import weight_rows
from surojax.peft.lora import (LORA_TARGETS, apply_lora, base_linear, fold_into, lora_modules, model_targets,
                               resolve_model_targets, vision_lora_modules)
from surojax.peft.peft_io import load_peft_adapter
from surojax.peft.trained_router import peft_router_rows, set_router
from surojax.peft.vision_lora import apply_vision_lora, tower_dims, tower_linears

log = logging.getLogger(__name__)


def load_adapter_into(model, adapter_dir: str | os.PathLike, *, trainable: bool, dropout: float | None = None,
                      dtype=jnp.float32):
    """Load a PEFT adapter into `model` (in place; returns the model).

    trainable=False: fold it into the base kernels (the model stays plain, or keeps its current adapter on
    top). trainable=True: it becomes the model's LoRA adapter (LoRAParam A/B in `dtype`), to continue training;
    `dropout` (default: the adapter's lora_dropout) applies in training mode.
    """
    dims = {t: (base_linear(model, t).in_features, base_linear(model, t).out_features) for t in model_targets(model)}
    moe = model.cfg.moe
    adapter = load_peft_adapter(adapter_dir, rows=tuple(weight_rows(model.cfg)), num_layers=model.cfg.num_layers,
                                dims=dims, num_experts=moe.num_experts if moe is not None else None,
                                router_rows=peft_router_rows(model.cfg), model_cfg=model.cfg,
                                vision_dims=tower_dims(model))
    spec = adapter.spec
    if adapter.router:  # a router trained with the adapter (modules_to_save): replaced, trainable with it or not
        set_router(model, adapter.router, trainable=trainable, dtype=dtype)
    if not trainable:
        for t, (a, b) in adapter.weights.items():
            fold_into(base_linear(model, t), a, b, spec.scaling)
        linears = tower_linears(model)
        for path, (a, b) in adapter.vision.items():
            fold_into(linears[path], a, b, spec.scaling)
        return model
    settings = dict(rank=spec.rank, alpha=spec.alpha, use_rslora=spec.use_rslora,
                    dropout=spec.dropout if dropout is None else dropout, rngs=nnx.Rngs(0), dtype=dtype)
    if adapter.weights:
        apply_lora(model, targets=spec.targets, **settings)
    if adapter.vision:
        apply_vision_lora(model, paths=adapter.vision, **settings)
    pairs = [(mod, adapter.weights[t]) for t, mod in lora_modules(model).items()]
    pairs += [(mod, adapter.vision[p]) for p, mod in vision_lora_modules(model).items()]
    for mod, (a, b) in pairs:
        mod.lora_a.set_value(jnp.asarray(a, dtype))
        mod.lora_b.set_value(jnp.asarray(b, dtype))
    return model


def init_lora(model, *, targets: str | Sequence[str] = LORA_TARGETS, rank: int, alpha: float, dropout: float = 0.0,
              use_rslora: bool = False, rngs: nnx.Rngs, dtype=jnp.float32,
              adapter_path: str | os.PathLike | None = None, adapter_init_mode: str | None = None,
              vision: bool = False):
    """The trainer's one call: a fresh adapter, or a stacked start from `adapter_path` (merge by default).
    vision: adapters on the vision tower's Linears too (train_vision with LoRA: peft/vision_lora.py)."""
    def fresh():
        apply_lora(model, targets=targets, rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora,
                   rngs=rngs, dtype=dtype)
        if vision:
            apply_vision_lora(model, rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora, rngs=rngs,
                              dtype=dtype)
        return model

    if adapter_path is None:
        return fresh()
    mode = adapter_init_mode or "merge"
    if mode == "merge":
        load_adapter_into(model, adapter_path, trainable=False)
        return fresh()
    if mode != "trainable":
        raise ValueError(f"adapter_init_mode {adapter_init_mode!r} is unknown (merge, trainable)")
    load_adapter_into(model, adapter_path, trainable=True, dropout=dropout, dtype=dtype)
    has_tower = bool(vision_lora_modules(model))
    if has_tower and not vision:
        raise ValueError(f"adapter_init_mode: trainable continues {adapter_path} as saved, which has adapters on the "
                         "vision tower; set train_vision: true to train them (or adapter_init_mode: merge to fold them "
                         "into the base)")
    if vision and not has_tower:
        raise ValueError(f"train_vision: true with LoRA puts adapters on the vision tower, and adapter_init_mode: "
                         f"trainable continues {adapter_path} as saved, which has none there; use adapter_init_mode: "
                         "merge (fresh adapters on the language model and the tower over the folded one), or remove "
                         "train_vision")
    spec = next(iter(lora_modules(model).values()))
    asked = (tuple(resolve_model_targets(model, targets)), rank, float(alpha), use_rslora)
    got = (tuple(lora_modules(model)), spec.rank, float(spec.alpha), spec.use_rslora)
    if asked != got:
        log.warning("%s: continuing the adapter as saved (targets, r, alpha, rslora) = %s; the settings asked for %s "
                    "apply only to a fresh adapter", adapter_path, got, asked)
    return model
