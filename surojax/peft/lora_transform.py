"""LoRA as a run's transform (surojax.models.transform): adapters on the (quantised) base's targets, and what
trains is the adapters.

    LoraTransform(rank=16, alpha=32, targets=("q_proj", ...), dropout=0.05, seed=run_seed + 1, dtype=fp32)
      apply          `init_lora` (a fresh adapter, or stacked on `adapter_path`: stacked.py); `vision`: adapters on
                     the vision tower's Linears too (train_vision with LoRA: vision_lora.py)
      freezes_base   True: the model's own nnx.Params stop training
      trainable      TRAINABLE (nnx.LoRAParam: the adapters, and a MoE router that trains with them)
      hooks          with dropout: fresh dropout keys before each micro-batch (`set_dropout_key`)
      memory         mode lora, the rank, the targets and the adapters' dtype (plan_memory; the tower's adapters
                     from the run's train_vision)
"""
from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from surojax.hub import model_path
from surojax.models.transform import StepHooks
from surojax.peft.lora import TRAINABLE, set_dropout_key
from surojax.peft.stacked import init_lora


class LoraTransform:
    name = "lora"
    freezes_base = True
    trainable = TRAINABLE

    def __init__(self, *, rank: int, alpha: float, targets: str | Sequence[str], dropout: float = 0.0,
                 use_rslora: bool = False, seed: int = 0, dtype=jnp.float32, adapter_path: str | None = None,
                 adapter_init_mode: str | None = None, vision: bool = False):
        self.rank, self.alpha, self.targets, self.dropout = rank, alpha, targets, dropout
        self.use_rslora, self.seed, self.dtype = use_rslora, seed, dtype
        self.adapter_path, self.adapter_init_mode = adapter_path, adapter_init_mode
        self.vision = vision

    def apply(self, model: nnx.Module) -> None:
        init_lora(model, targets=self.targets, rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                  use_rslora=self.use_rslora, rngs=nnx.Rngs(params=self.seed), dtype=self.dtype,
                  # a folder or a Hub id
                  adapter_path=model_path(self.adapter_path) if self.adapter_path else None,
                  adapter_init_mode=self.adapter_init_mode, vision=self.vision)

    @property
    def hooks(self) -> StepHooks | None:
        if self.dropout <= 0:
            return None
        return StepHooks(before_micro=lambda model, key, _: set_dropout_key(model, key))

    @property
    def memory(self) -> dict:
        return {"mode": "lora", "rank": self.rank, "targets": self.targets,
                "lora_dtype": "fp32" if self.dtype == jnp.float32 else "bf16"}

    def summary(self) -> str:
        stacked = f", stacked on {self.adapter_path} ({self.adapter_init_mode or 'merge'})" if self.adapter_path \
            else ""
        targets = self.targets if isinstance(self.targets, str) else ", ".join(self.targets)
        if self.vision:
            targets += " + the vision tower's Linears"
        return (f"rank {self.rank}, alpha {self.alpha:g}{', rsLoRA' if self.use_rslora else ''} on {targets}, "
                f"dropout {self.dropout:g}, {jnp.dtype(self.dtype).name} adapters{stacked}")


__all__ = ["LoraTransform"]
