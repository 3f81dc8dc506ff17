"""Trainer kinds by the config's `trainer` key: the class that runs a config.

`sft` is `surojax.train.trainer.Trainer` (supervised fine-tuning and pretraining). Post-training trainers subclass it
(its `loss`, `build_data` and `next_batch` hooks) and are registered here under the name the config uses.
"""
from __future__ import annotations

from surojax.config import TrainConfig
from surojax.train.distill import DistillTrainer
from surojax.train.dpo import DPOTrainer
from surojax.train.grpo import GRPOTrainer
from surojax.train.trainer import Trainer

TRAINERS: dict[str, type[Trainer]] = {"sft": Trainer, "dpo": DPOTrainer, "grpo": GRPOTrainer,
                                      "distill": DistillTrainer}


def trainer_class(cfg: TrainConfig) -> type[Trainer]:
    """The Trainer class for `cfg.trainer` (the config schema only admits registered names)."""
    return TRAINERS[cfg.trainer]


def make_trainer(cfg: TrainConfig, **kwargs) -> Trainer:
    return trainer_class(cfg)(cfg, **kwargs)
