"""Many LoRA adapters served at once, one per batch row: a transform applied to a built `Decoder` for serving.

    y[b] = base(x[b]) + (x[b] @ A[slot[b]]) @ B[slot[b]]      A [L, S, in, R], B [L, S, R, out] (scaling in B)

`apply_multi_lora` swaps each targeted `Linear` of `model.layers` for a `MultiLoRALinear` holding S = 1 +
max_loras adapter slots; slot 0 is all zeros (= the base model), so rows without an adapter and rows of
different adapters run in the same batch. Ranks are padded with zeros to `max_rank` and each adapter's
scaling (alpha / r) is folded into its B at load, so adapters of different rank and alpha share one shape and
loading / unloading never recompiles.

The per-row slot index reaches the layers as a variable (`AdapterRowIndex`, [L, B]: the decoder scans over
the layers axis, so every variable inside it carries L first): the serving step calls
`set_adapter_rows(model, rows)` on the merged model inside its jitted function, as the trainer sets LoRA
dropout keys. The model code is unchanged.

Cost: per targeted module and layer, a gather of each row's A and B ([B, in, R] + [B, R, out]) and two small
GEMMs; with no adapter loaded the rows still multiply by zeros (the server only wraps when --enable-lora).

`AdapterSlots` is the host-side book-keeping: name -> slot, loading PEFT folders (as `surojax export` writes
them) into a free slot, unloading.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.registry import GEMMA4_STACKS, LINEAR_MODULES, weight_rows
from surojax.models.targets import LORA_TARGETS, module_at, replace_module, resolve_targets
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
    out = {}
    for name, sub in LINEAR_MODULES.items():
        parent, _, leaf = sub.rpartition(".")
        mod = getattr(module_at(model.layers, parent), leaf, None)  # None: a MoE layer has no mlp.gate_proj
        if isinstance(mod, MultiLoRALinear):
            out[name] = mod
    return out


def apply_multi_lora(model, *, max_loras: int, max_rank: int, targets: str | Sequence[str] = LORA_TARGETS,
                     dtype=None):
    """Wrap the targeted Linears (in place; returns the model). Slots: 0 = none, 1..max_loras = adapters."""
    if max_loras < 1 or max_rank < 1:
        raise LoRASlotError(f"max_loras and max_lora_rank must be >= 1 (got {max_loras}, {max_rank})")
    if multi_lora_modules(model):
        raise LoRASlotError("the model already has multi-LoRA slots")
    other = "linear_layers" if model.cfg.linear_attention is not None else \
        "conv_layers" if getattr(model.cfg, "short_conv", None) is not None else None
    if other is not None:
        kind = "Gated DeltaNet" if other == "linear_layers" else "short convolution"
        raise LoRASlotError(f"{model.cfg.model_type}: runtime LoRA adapters are not supported for hybrid models: the "
                            "adapter slots wrap every layer of the one stack `layers`, and a hybrid's layers are split "
                            f"between `layers` (attention) and `{other}` ({kind})")
    split = [name for name in GEMMA4_STACKS[1:] if getattr(model, name, None) is not None]
    if split:
        raise LoRASlotError(f"{model.cfg.model_type}: runtime LoRA adapters are not supported with attention layers "
                            f"outside `layers` ({', '.join(split)}: Gemma 4's full layers of their own shape / "
                            "KV-shared layers): the adapter slots wrap every layer of the one stack `layers`")
    dtype = dtype or model.dtype
    for name in resolve_targets(targets):
        base = module_at(model.layers, LINEAR_MODULES[name])
        if not hasattr(base, "in_features"):
            raise LoRASlotError(f"cannot serve LoRA adapters on {name}: it is not a plain Linear ({type(base).__name__})")
        replace_module(model.layers, LINEAR_MODULES[name],
                       MultiLoRALinear(base, num_layers=model.cfg.num_layers, num_slots=max_loras + 1,
                                       rank=max_rank, dtype=dtype))
    return model


def set_adapter_rows(model, rows: jax.Array) -> None:
    """Give every MultiLoRALinear the slot index of each batch row ([B] int32). Call inside the jitted step."""
    L = model.cfg.num_layers
    for mod in multi_lora_modules(model).values():
        mod.rows.set_value(jnp.broadcast_to(rows.astype(jnp.int32)[None, :], (L, rows.shape[0])))


class AdapterSlots:
    """Host-side registry: adapter name -> slot of the model's MultiLoRALinear stacks."""

    def __init__(self, model, *, max_loras: int = 4, max_rank: int = 64, targets=LORA_TARGETS, dtype=None):
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
        cfg = self.model.cfg
        dims = {t: (m.in_features, m.out_features) for t, m in self.modules.items()}
        adapter = load_peft_adapter(path, rows=tuple(weight_rows(cfg)), num_layers=cfg.num_layers,
                                    dims={t: dims.get(t, (0, 0)) for t in LORA_TARGETS})
        spec = adapter.spec
        missing = [t for t in adapter.weights if t not in self.modules]
        if missing:
            raise LoRASlotError(f"{path}: adapter targets {missing}, which the server does not wrap")
        if spec.rank > self.max_rank:
            raise LoRASlotError(f"{path}: adapter rank {spec.rank} > --max-lora-rank {self.max_rank}")
        slot = free[0]
        for t, mod in self.modules.items():
            a_all, b_all = mod.lora_a.get_value(), mod.lora_b.get_value()
            a = np.zeros(a_all.shape[:1] + a_all.shape[2:], np.float32)  # [L, in, Rmax]
            b = np.zeros(b_all.shape[:1] + b_all.shape[2:], np.float32)  # [L, Rmax, out]
            if t in adapter.weights:
                wa, wb = adapter.weights[t]
                a[:, :, :spec.rank] = wa
                b[:, :spec.rank, :] = wb * spec.scaling
            mod.lora_a.set_value(a_all.at[:, slot].set(jnp.asarray(a, a_all.dtype)))
            mod.lora_b.set_value(b_all.at[:, slot].set(jnp.asarray(b, b_all.dtype)))
        self.slots[name] = slot
        self.paths[name] = str(path)
        return slot

    def unload(self, name: str) -> None:
        slot = self.slot(name)
        if slot == 0:
            raise LoRASlotError("the base model cannot be unloaded")
        for mod in self.modules.values():
            mod.lora_a.set_value(mod.lora_a.get_value().at[:, slot].set(0))
            mod.lora_b.set_value(mod.lora_b.get_value().at[:, slot].set(0))
        del self.slots[name], self.paths[name]
