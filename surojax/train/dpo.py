"""DPOTrainer (config `trainer: dpo`): the shared training loop with the DPO loss over preference pairs.

Batches are pairs: arrays [A*B, 2, T] (chosen, rejected) from surojax/data/preference.py, B counting pairs.
The reference policy is
    LoRA / QLoRA      the same model with its adapters disabled, run inside the loss under stop_gradient
                      (surojax.losses.dpo): no second copy of the weights;
    full fine-tune    log-probs of the initial weights, computed in one pass over the train and validation
                      pairs before the first step (also when resuming: the initial weights are the ones build_run
                      made, before the checkpoint is restored) and added to each batch as `ref_logps` [.., 2];
    reference_free    none (0).
Metrics per step: loss (mean over pairs), rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies
(means over the step's pairs; TRL's definitions, surojax/losses/dpo.py). A mixture-of-experts policy adds its
router losses (build_run passes `router=`) and reports the router metrics as SFT does.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from surojax.config.policy_loss import resolved_beta, resolved_loss_type
from surojax.data.preference import PreferenceData, build_preference_data
from surojax.losses.dpo import METRIC_KEYS, DPOSettings, dpo_loss, sequence_logps
from surojax.parallel import batch_sharding
from surojax.peft.lora import adapters_disabled, lora_modules
from surojax.train.run_spec import TrainSetupError
from surojax.train.trainer import Trainer

PAIR_FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")  # [.., 2, T] each


class DPOTrainer(Trainer):
    """Trainer with the DPO task hooks; everything else (checkpoints, resume, export, metrics) is the Trainer's."""

    data: PreferenceData

    settings: DPOSettings  # made once from the config (beta, loss_type, label_smoothing, reference_free)

    @property
    def loss(self):
        """The pure loss build_run compiles: dpo_loss with this run's settings (read once `self.spec` is made)."""
        lora, free = self.spec.lora is not None, self.settings.reference_free
        if lora and self.spec.moe is not None and self.spec.moe.train_router and not free:
            raise TrainSetupError("train_router: the reference of a LoRA DPO run is the base without the adapter, "
                                  "but train_router changes the base's routers; use train_router: false or "
                                  "reference_free: true")
        without_adapter = adapters_disabled if lora and not free else None
        return functools.partial(dpo_loss, settings=self.settings, without_adapter=without_adapter)

    @property
    def needs_reference_pass(self) -> bool:
        """Full fine-tuning with a reference: its log-probs come from one pass over the data before training."""
        return not self.settings.reference_free and self.spec.lora is None

    def __init__(self, cfg, **kwargs):
        self.settings = DPOSettings(beta=resolved_beta(cfg), loss_type=resolved_loss_type(cfg),
                                    label_smoothing=cfg.label_smoothing, reference_free=cfg.reference_free)
        self._reference: dict[str, np.ndarray] = {}  # "train" / "eval" -> ref log-prob sums [pairs, 2]
        super().__init__(cfg, **kwargs)
        self._reference_pass()

    # ---- task hooks -----------------------------------------------------------------------------------------
    def build_data(self, *, batch_size: int, eval_batch_size: int, num_epochs: int | None) -> PreferenceData:
        c = self.cfg
        return build_preference_data(c.datasets, self.tokenizer, sequence_len=c.sequence_len, batch_size=batch_size,
                                     seed=c.seed, skip_invalid_rows=c.skip_invalid_rows,
                                     validation_split_ratio=c.validation_split_ratio,
                                     validation_datasets=c.validation_datasets, num_epochs=num_epochs,
                                     eval_batch_size=eval_batch_size, chat_template=c.chat_template)

    def next_batch(self) -> dict:
        return self._with_reference(next(self.data.train), "train")

    def _with_reference(self, batch: dict, split: str) -> dict:
        """Drop the pair index; add the precomputed reference log-probs [.., 2] where the run has them."""
        batch = dict(batch)
        index = batch.pop("pair")
        if split in self._reference:
            ref = self._reference[split]
            batch["ref_logps"] = np.where((index >= 0)[:, None], ref[np.maximum(index, 0)], 0.0).astype(np.float32)
        return batch

    # ---- batches on the devices: pairs [.., B, 2, T] split over the data axes like rows --------------------
    def _pair_sharding(self, x: np.ndarray, lead: int) -> NamedSharding:
        rows, seq = (*batch_sharding(self.mesh).spec, None, None)[:2]  # the [B, T] rule's axes
        trailing = (None, seq) if x.ndim - lead == 3 else (None,) * (x.ndim - lead - 1)
        return NamedSharding(self.mesh, P(*(None,) * lead, rows, *trailing))

    def _device_batch(self, batch: dict) -> dict:
        A, B = self.plan.accumulation, self.plan.micro_batch
        shaped = {k: v.reshape(A, B, *v.shape[1:]) for k, v in batch.items()}
        return {k: jax.device_put(v, self._pair_sharding(v, 1)) for k, v in shaped.items()}

    def step(self) -> dict:
        m = super().step()
        pairs = max(m["tokens"], 1.0)  # the loss's count: real pairs
        for k in METRIC_KEYS:
            m[k] /= pairs
        m["pairs"] = m.pop("tokens")
        m["tokens_per_s"] *= 2  # two sequences of sequence_len per pair
        return m

    def evaluate(self) -> float | None:
        """Mean DPO loss over the validation pairs (None without validation data)."""
        if self.data.eval is None:
            return None
        total, count = 0.0, 0.0
        for batch in self.data.eval:
            batch = self._with_reference(batch, "eval")
            s, n = self.run.eval_step(self.trainable, self.frozen,
                                      {k: jax.device_put(v, self._pair_sharding(v, 0)) for k, v in batch.items()})
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)

    # ---- the reference pass (full fine-tuning) --------------------------------------------------------------
    def _resume(self) -> None:
        self._reference_pass()  # with the initial weights, before the checkpoint replaces them
        super()._resume()

    def _reference_pass(self) -> None:
        """Log-prob sums [pairs, 2] of the train (and validation) pairs under the current (initial) weights."""
        if not self.needs_reference_pass or self._reference:
            return
        if lora_modules(nnx.merge(self.run.eval_graphdef, self.trainable, self.frozen)):
            raise TrainSetupError("internal: a LoRA run takes its reference from the base inside the loss")
        graphdef, chunk = self.run.eval_graphdef, self.run.chunk

        @jax.jit
        def logps(trainable, frozen, batch):
            return sequence_logps(nnx.merge(graphdef, trainable, frozen), batch, chunk=chunk)

        size = self.plan.micro_batch
        for split, rows in (("train", self.data.train_rows), ("eval", self.data.eval_rows)):
            if rows is None:
                continue
            out = np.zeros((len(rows), 2), np.float32)
            for start in range(0, len(rows), size):
                items = [rows[min(i, len(rows) - 1)] for i in range(start, start + size)]
                batch = {k: np.stack([r[k] for r in items]) for k in PAIR_FIELDS}
                batch = {k: jax.device_put(v, self._pair_sharding(v, 0)) for k, v in batch.items()}
                got = np.asarray(jax.device_get(logps(self.trainable, self.frozen, batch)))
                n = min(size, len(rows) - start)
                out[start:start + n] = got[:n]
            self._reference[split] = out
        self.console.print(f"reference log-probs of {len(self.data.train_rows):,} pairs computed (full fine-tuning: "
                           "one pass with the initial weights)", highlight=False)
