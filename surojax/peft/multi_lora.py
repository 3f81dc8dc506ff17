"""Many LoRA adapters served at once, one per batch row: a transform applied to a built `Decoder` for serving.

    y[b] = base(x[b]) + (x[b] @ A[slot[b]]) @ B[slot[b]]      A [L, S, in, R], B [L, S, R, out] (scaling in B)

`apply_multi_lora` swaps each targeted `Linear` for a `MultiLoRALinear` holding S = 1 + max_loras adapter slots,
in every layer stack that has it (models/targets.py's sites: a hybrid's MLP projections in `layers` and in
`linear_layers` / `conv_layers`, its attention projections in `layers`, its Gated DeltaNet / short-convolution
projections in its own stack; Gemma 4's `global_layers` / KV-shared stacks); each stack's MultiLoRALinear holds that
stack's rows (L = its layer count). Slot 0 is all zeros (= the base model), so rows without an adapter and rows of
different adapters run in the same batch. Ranks are padded with zeros to `max_rank` and each adapter's
scaling (alpha / r) is folded into its B at load, so adapters of different rank and alpha share one shape and
loading / unloading never recompiles.

The per-row slot index reaches the layers as a variable (`AdapterRowIndex`, [L, B]: the decoder scans over
each stack's layers axis, so every variable inside a stack carries its L first): the serving step calls
`set_adapter_rows(model, rows)` on the merged model inside its jitted function, as the trainer sets LoRA
dropout keys. The model code is unchanged.

Cost: per targeted module and layer, a gather of each row's A and B ([B, in, R] + [B, R, out]) and two small
GEMMs; with no adapter loaded the rows still multiply by zeros (the server only wraps when --enable-lora).

`AdapterSlots` is the host-side book-keeping: name -> slot, loading PEFT folders (as `surojax export` or peft
writes them) into a free slot, unloading. An adapter's tensors are named by the HF layer index (model.layers.{i});
the loader (peft_io.load_peft_adapter with the model's config) puts layer i in the row of the stack that holds it
(registry.stack_layers, the decoder's layer pattern). An adapter on a module the server does not wrap (a MoE
model's experts: grouped GEMMs, not Linears) is refused by name.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.registry import stack_layers, weight_rows
from surojax.models.targets import (EXPERT_TARGETS, base_linear, model_targets, module_at, replace_module,
                                    resolve_model_targets, site, site_stack, target_name)
from surojax.peft.peft_io import load_peft_adapter


class AdapterSlotWeights(nnx.Variable):
    """Stacked adapter weights of every slot: A [L, S, in, R] or B [L, S, R, out]. Not a Param: never trained."""


class AdapterRowIndex(nnx.Variable):
    """The adapter slot of each batch row, [L, B] (the same row vector repeated per layer)."""


class LoRASlotError(ValueError):
    """A LoRA adapter that cannot be loaded / found / unloaded as asked."""

    is_user_error = True


class MultiLoRALinear(nnx.Module):
    def __init__(self, base: nnx.Module, *, num_layers: int, num_slots: int, rank: int, dtype):
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_a = AdapterSlotWeights(jnp.zeros((num_layers, num_slots, base.in_features, rank), dtype))
        self.lora_b = AdapterSlotWeights(jnp.zeros((num_layers, num_slots, rank, base.out_features), dtype))
        self.rows = AdapterRowIndex(jnp.zeros((num_layers, 1), jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:  # x [B, T, in] -> [B, T, out]; inside the scan: one layer
        y = self.base(x)
        idx = self.rows[...]  # [B]
        if idx.shape[0] != x.shape[0]:
            idx = jnp.broadcast_to(idx[:1], (x.shape[0],))
        a = self.lora_a[...][idx].astype(x.dtype)  # [B, in, R]
        b = self.lora_b[...][idx].astype(x.dtype)  # [B, R, out]
        h = jnp.einsum("bti,bir->btr", x, a)
        return y + jnp.einsum("btr,bro->bto", h, b)


def multi_lora_modules(model) -> dict[str, MultiLoRALinear]:
    """Site key (models/targets.py: "q_proj" in `layers`, "linear_layers.gate_proj", ...) -> its MultiLoRALinear."""
    out = {}
    for key in model_targets(model):
        mod = module_at(*site(model, key))
        if isinstance(mod, MultiLoRALinear):
            out[key] = mod
    return out


def slot_sites(model, targets: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The site keys the slots wrap. targets None: every plain Linear target of every stack (a MoE model's experts
    are not Linears: skipped, and an adapter on them is refused at load); else the user's names (resolve_model_targets:
    "all-linear", HF spellings), each in every stack that has it, all of which must be plain Linears."""
    if targets is None:
        keys = tuple(k for k in model_targets(model) if target_name(k) not in EXPERT_TARGETS)
    else:
        keys = resolve_model_targets(model, targets)
    for key in keys:
        base = module_at(*site(model, key))
        if not hasattr(base, "in_features") or target_name(key) in EXPERT_TARGETS:
            raise LoRASlotError(f"cannot serve LoRA adapters on {key}: it is not a plain Linear "
                                f"({type(base).__name__})")
    return keys


def apply_multi_lora(model, *, max_loras: int, max_rank: int, targets: str | Sequence[str] | None = None,
                     dtype=None):
    """Wrap the targeted Linears of every stack (in place; returns the model). Slots: 0 = none, 1..max_loras =
    adapters. targets: `slot_sites` (None: every Linear target the model has)."""
    if max_loras < 1 or max_rank < 1:
        raise LoRASlotError(f"max_loras and max_lora_rank must be >= 1 (got {max_loras}, {max_rank})")
    if multi_lora_modules(model):
        raise LoRASlotError("the model already has multi-LoRA slots")
    dtype = dtype or model.dtype
    for key in slot_sites(model, targets):
        root, path = site(model, key)
        base = module_at(root, path)
        replace_module(root, path, MultiLoRALinear(base, num_layers=len(stack_layers(model.cfg, site_stack(key))),
                                                   num_slots=max_loras + 1, rank=max_rank, dtype=dtype))
    return model


def set_adapter_rows(model, rows: jax.Array) -> None:
    """Give every MultiLoRALinear the slot index of each batch row ([B] int32), repeated over its stack's layers.
    Call inside the jitted step."""
    rows = rows.astype(jnp.int32)
    for mod in multi_lora_modules(model).values():
        L = mod.lora_a.get_value().shape[0]
        mod.rows.set_value(jnp.broadcast_to(rows[None, :], (L, rows.shape[0])))


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(stack: jax.Array, value: jax.Array, slot) -> jax.Array:
    """stack [L, slots, ...] with slot ``slot`` (a traced index: one program per stack shape, whichever slot)
    replaced by value [L, ...], in place (the stack is donated: no second copy of the slots while loading)."""
    return jax.lax.dynamic_update_index_in_dim(stack, value, slot, axis=1)


class AdapterSlots:
    """Host-side registry: adapter name -> slot of the model's MultiLoRALinear stacks."""

    def __init__(self, model, *, max_loras: int = 4, max_rank: int = 64, targets=None, dtype=None):
        self.model = apply_multi_lora(model, max_loras=max_loras, max_rank=max_rank, targets=targets, dtype=dtype)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.modules = multi_lora_modules(model)
        self.slots: dict[str, int] = {}
        self.paths: dict[str, str] = {}

    def slot(self, name: str | None) -> int:
        if name is None:
            return 0
        if name not in self.slots:
            raise LoRASlotError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.slots) or 'none'})")
        return self.slots[name]

    def load(self, name: str, path: str | os.PathLike) -> int:
        """Read a PEFT adapter folder into a free slot -> the slot. Errors name the folder and what is wrong."""
        if name in self.slots:
            raise LoRASlotError(f"a LoRA adapter named {name!r} is already loaded (from {self.paths[name]})")
        free = [s for s in range(1, self.max_loras + 1) if s not in self.slots.values()]
        if not free:
            raise LoRASlotError(f"all {self.max_loras} LoRA slots are in use ({', '.join(sorted(self.slots))}); "
                                "unload one or start the server with a larger --max-loras")
        model = self.model
        cfg, moe = model.cfg, model.cfg.moe
        dims = {k: (base_linear(model, k).in_features, base_linear(model, k).out_features)
                for k in model_targets(model)}
        # the model's config: each tensor's HF layer index -> (stack, row) (registry.stack_layers)
        adapter = load_peft_adapter(path, rows=tuple(weight_rows(cfg)), num_layers=cfg.num_layers, dims=dims,
                                    num_experts=moe.num_experts if moe is not None else None, model_cfg=cfg)
        spec = adapter.spec
        missing = [t for t in adapter.weights if t not in self.modules]
        if missing:
            raise LoRASlotError(f"{path}: adapter targets {missing}, which the server does not wrap (it serves "
                                f"adapters on {', '.join(self.modules)})")
        if spec.rank > self.max_rank:
            raise LoRASlotError(f"{path}: adapter rank {spec.rank} > --max-lora-rank {self.max_rank}")
        slot = free[0]
        for t, mod in self.modules.items():
            a_all, b_all = mod.lora_a.get_value(), mod.lora_b.get_value()
            a = np.zeros(a_all.shape[:1] + a_all.shape[2:], np.float32)  # [L of its stack, in, Rmax]
            b = np.zeros(b_all.shape[:1] + b_all.shape[2:], np.float32)  # [L of its stack, Rmax, out]
            if t in adapter.weights:
                wa, wb = adapter.weights[t]
                a[:, :, :spec.rank] = wa
                b[:, :spec.rank, :] = wb * spec.scaling
            mod.lora_a.set_value(_write_slot(a_all, jnp.asarray(a, a_all.dtype), slot))
            mod.lora_b.set_value(_write_slot(b_all, jnp.asarray(b, b_all.dtype), slot))
        self.slots[name] = slot
        self.paths[name] = str(path)
        return slot

    def unload(self, name: str) -> None:
        slot = self.slot(name)
        if slot == 0:
            raise LoRASlotError("the base model cannot be unloaded")
        for mod in self.modules.values():
            for param in (mod.lora_a, mod.lora_b):
                stack = param.get_value()
                param.set_value(_write_slot(stack, jnp.zeros(stack.shape[:1] + stack.shape[2:], stack.dtype), slot))
        del self.slots[name], self.paths[name]
