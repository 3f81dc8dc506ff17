"""The training loop: config -> model + data + optimizer -> steps, evals, checkpoints -> exported artifacts.

    trainer = Trainer(cfg)          # loads everything and checks it fits before the first step
    trainer.step()                  # one optimizer step (A micro-batches), returns its metrics
    trainer.train()                 # the whole run: progress bar, evals, checkpoints, export, loss chart
    trainer.evaluate()              # mean loss over the validation set
    trainer.export()                # PEFT adapter (LoRA) or HF folder (full), with the tokenizer

Determinism: the data order comes from the loader's seed and checkpointed position, the dropout key of step
s is fold_in(key(seed), s), so a run resumed from a checkpoint repeats the uninterrupted run's losses.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from surojax.losses.lm import lm_chunk_tokens, lm_loss
from surojax.models.layers.attention import packed_backend
from surojax.offload.memory_plan import check_fits, device_capacity, plan_for_config
from surojax.offload.master import place_master_on_host
from surojax.offload.optimizer import apply_master_updates, compute_copy, master_params
from surojax.offload.remat import layer_loop
from surojax.offload.settings import OFFLOAD_AVAILABLE, check_offload_settings
from surojax.offload.streaming import build_context, place_model
from surojax.train.checkpoints import Checkpointer, key_to_array
from surojax.train.metrics import Metrics, plot_loss
from surojax.train.model_setup import (TrainSetupError, build_model, is_gguf_path, model_config_for, precision_for,
                                        trainable_filter)
from surojax.train.optim import build_optimizer, init_opt_state, lr_schedule
from surojax.train.step import make_eval_step, make_train_step

log = logging.getLogger(__name__)
CHINCHILLA_TOKENS_PER_PARAM = 20


def _count(state) -> int:
    """Parameters (a quantised weight counts its logical [.., K, N] values, not its packed bytes)."""
    from surojax.quant.base import QuantFormat

    def size(x):
        if isinstance(x, QuantFormat):
            return int(np.prod(jax.eval_shape(lambda v: v.dequantize(jnp.float32), x).shape))
        return int(np.prod(x.shape))
    return int(sum(size(x) for x in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, QuantFormat))))


@dataclasses.dataclass
class RunPlan:
    total_steps: int
    micro_batch: int  # rows per micro-batch (global)
    accumulation: int
    sequence_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.accumulation * self.sequence_len


class Trainer:
    def __init__(self, cfg, *, console=None):
        from rich.console import Console

        from surojax.data.hub import resolve_local
        from surojax.data.pipeline import build_data_from_config
        from surojax.data.tokenizer import Tokenizer
        from surojax.parallel import batch_sharding, make_mesh

        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.output_dir = Path(cfg.output_dir)
        self._check_output_dir()
        model_config_for(cfg)  # cheap: the architecture is checked before data and weights are touched
        check_offload_settings(cfg)
        tok_src = cfg.tokenizer or cfg.model
        if tok_src is None:
            raise TrainSetupError("tokenizer: needed when from_scratch has no `model` folder to take it from")
        if is_gguf_path(tok_src):  # the tokenizer of a GGUF base is in its metadata: export it once, as HF files
            from surojax.weights.gguf_checkpoint import load_gguf_tokenizer
            from surojax.weights.gguf_tokenizer import save_tokenizer_dir

            self.tokenizer_dir = save_tokenizer_dir(load_gguf_tokenizer(tok_src), self.output_dir / "gguf_tokenizer")
        else:
            self.tokenizer_dir = Path(resolve_local(tok_src))
        self.tokenizer = Tokenizer.from_dir(self.tokenizer_dir)

        self.mesh = make_mesh(cfg.parallel)
        dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        A, B = cfg.gradient_accumulation_steps, cfg.per_device_train_batch_size * dp
        epochs = None if cfg.max_steps else max(1, math.ceil(cfg.num_epochs))
        self.data = build_data_from_config(cfg, self.tokenizer, batch_size=A * B, seed=cfg.seed, num_epochs=epochs,
                                           eval_batch_size=B)
        if cfg.max_steps:
            total = cfg.max_steps
        else:
            total = max(1, int(self.data.train.num_rows * cfg.num_epochs // (A * B)))
        self.plan = RunPlan(total, B, A, cfg.sequence_len)
        self.chunk = lm_chunk_tokens(B, cfg.sequence_len, cfg.lmhead_chunks)
        self.memory_plan = plan_for_config(cfg, model_config_for(cfg), rows=cfg.per_device_train_batch_size,
                                           lm_chunk_tokens=self.chunk)
        if self.mesh.shape["fsdp"] * self.mesh.shape["tensor"] == 1:  # the estimate is for an unsharded device
            check_fits(self.memory_plan, device_capacity(),  # before any weight is allocated
                       offload_available=OFFLOAD_AVAILABLE)

        self.attention = packed_backend(cfg.attention, max(
            rows.max_runs for rows in (self.data.train_rows, self.data.eval_rows) if rows is not None))
        if self.attention != cfg.attention:
            log.info("attention: %s (cuDNN over the packed rows, at most %s samples + padding per row)",
                     self.attention, self.attention.split(":")[1])
        with build_context(cfg.offload_base_weights or cfg.offload_master):  # a base / master bound for host
            self.model = build_model(cfg, attention=self.attention)         # memory is built off the device
        if self.tokenizer.vocab_size > self.model.cfg.vocab_size:
            raise TrainSetupError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                                  f"{self.model.cfg.vocab_size}")
        if cfg.offload_master:  # the layers' fp32 Params in host memory, never whole on the device
            place_master_on_host(self.model, self.mesh)
        else:
            place_model(self.model, self.mesh, offload_base=cfg.offload_base_weights,  # shard_model (+ base on host,
                        per_layer=cfg.offload_base_weights and cfg.offload_prefetch)  # per-layer buffers to prefetch)
        self.batch_sharding = NamedSharding(self.mesh, P(None, *batch_sharding(self.mesh).spec))

        warmup = cfg.warmup_steps_for(total) if hasattr(cfg, "warmup_steps_for") else (cfg.warmup_steps or 0)
        self.schedule = lr_schedule(cfg.lr_scheduler_type, cfg.learning_rate, total, warmup or 0,
                                    cfg.final_lr_fraction, cfg.cooldown_steps or 0)
        self.optimizer = build_optimizer(cfg.optimizer, self.schedule, weight_decay=cfg.weight_decay,
                                         b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                                         max_grad_norm=cfg.max_grad_norm, offload_state=cfg.offload_optimizer,
                                         offload_master=cfg.offload_master)

        self._train_mode = cfg.lora and cfg.lora_dropout > 0
        if self._train_mode:
            self.model.train()
        self.graphdef, self.trainable, self.frozen = nnx.split(self.model, trainable_filter(cfg), ...)
        self.model.eval()
        self.eval_graphdef = nnx.split(self.model, trainable_filter(cfg), ...)[0]
        self.opt_state = init_opt_state(self.optimizer, self.trainable, self.mesh)
        apply = {}
        if cfg.offload_master:  # the fp32 layers now live in the optimizer state (host); train their bf16 copy
            self.trainable = compute_copy(self.trainable, precision_for(cfg).compute)
            nnx.update(self.model, self.trainable)  # drops the model's reference to the fp32 device arrays
            apply = {"apply_updates": apply_master_updates}
        remat = layer_loop(cfg.recompute, prefetch=cfg.offload_prefetch)
        prepare = self._dropout_prepare() if self._train_mode else None
        self._train_step = make_train_step(self.graphdef, self._loss_fn, self.optimizer, remat=remat, prepare=prepare,
                                           **apply)
        self._eval_step = make_eval_step(self.eval_graphdef, self._loss_fn,
                                         remat=remat if cfg.offload_prefetch else None)
        self.key = jax.random.key(cfg.seed)
        self.step_count = 0

        self.checkpointer = Checkpointer(Path(cfg.checkpoint_dir or self.output_dir / "checkpoints"),
                                         keep=cfg.save_total_limit)
        self.metrics = Metrics(self.output_dir, cfg.report_to, run_config=cfg.model_dump(by_alias=True),
                               project=cfg.wandb_project or "surojax")
        if cfg.resume_from_checkpoint:
            self._resume()

    # ---- set-up helpers -------------------------------------------------------------------------------------
    def _check_output_dir(self) -> None:
        done = [p for p in (self.output_dir / "model", self.output_dir / "adapter") if p.exists()]
        if done and not self.cfg.resume_from_checkpoint:
            raise TrainSetupError(f"output_dir: {self.output_dir} already holds a trained {done[0].name} "
                                  f"({done[0]}); choose another output_dir or set resume_from_checkpoint")

    def _loss_fn(self, model, batch, remat=None):
        return lm_loss(model, batch, chunk=self.chunk, remat=remat, unroll=self.cfg.unroll_layers)

    @staticmethod
    def _dropout_prepare():
        from surojax.peft.lora import set_dropout_key

        return set_dropout_key

    def _resume(self) -> None:
        target = self.cfg.resume_from_checkpoint
        if isinstance(target, str):
            path = Path(target)
            self.checkpointer = Checkpointer(path.parent, keep=self.cfg.save_total_limit)
            step = int(path.name)
        else:
            step = self.checkpointer.latest_step()
            if step is None:
                log.warning("resume_from_checkpoint: no checkpoint in %s yet; starting from step 0",
                            self.checkpointer.directory)
                return
        state, meta = self.checkpointer.restore(step, self._checkpoint_state())
        self.trainable, self.opt_state = state["trainable"], state["opt_state"]
        self.data.train.set_state(meta["data"])
        self.step_count = int(meta["step"])
        self.console.print(f"[bold]resumed[/] from {self.checkpointer.directory / str(step)} at step {self.step_count}")

    def _checkpoint_state(self) -> dict:
        return {"trainable": self.trainable, "opt_state": self.opt_state, "rng": key_to_array(self.key)}

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.step_count, self._checkpoint_state(),
                               {"step": self.step_count, "data": self.data.train.get_state()})

    # ---- steps ----------------------------------------------------------------------------------------------
    def _device_batch(self, batch: dict) -> dict:
        A, B = self.plan.accumulation, self.plan.micro_batch
        shaped = {k: v.reshape(A, B, *v.shape[1:]) for k, v in batch.items()}
        return jax.device_put(shaped, self.batch_sharding)

    def step(self) -> dict:
        """One optimizer step over `gradient_accumulation_steps` micro-batches; returns float metrics."""
        t0 = time.perf_counter()
        batch = self._device_batch(next(self.data.train))
        lr = float(self.schedule(self.step_count))
        rng = jax.random.fold_in(self.key, self.step_count)
        self.trainable, self.opt_state, m = self._train_step(self.trainable, self.frozen, self.opt_state, batch, rng)
        self.step_count += 1
        m = {k: float(v) for k, v in m.items()}
        dt = time.perf_counter() - t0
        m.update(lr=lr, step_time=dt, tokens_per_s=self.plan.tokens_per_step / dt)
        return m

    def evaluate(self) -> float | None:
        """Mean loss per supervised token over the whole validation set (None without validation data)."""
        if self.data.eval is None:
            return None
        total, count = 0.0, 0.0
        for batch in self.data.eval:
            s, n = self._eval_step(self.trainable, self.frozen, jax.device_put(batch, NamedSharding(
                self.mesh, P(*self.batch_sharding.spec[1:]))))
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)

    # ---- the run --------------------------------------------------------------------------------------------
    def summary_lines(self) -> list[str]:
        n_total = _count(nnx.state(self.model, nnx.Param)) if not self.cfg.lora else (
            _count(self.frozen) + _count(self.trainable))
        n_train = _count(self.trainable)
        planned = self.plan.total_steps * self.plan.tokens_per_step
        budget = CHINCHILLA_TOKENS_PER_PARAM * n_total
        s = self.data.stats
        mode = "LoRA" if self.cfg.lora else ("pretraining" if self.cfg.from_scratch else "full fine-tune")
        return [
            f"model   {self.model.cfg.model_type}, {n_total / 1e6:.2f}M parameters, {n_train / 1e6:.3f}M trainable "
            f"({100 * n_train / max(n_total, 1):.2f}%), {mode}, recipe {self.cfg.recipe}, recompute {self.cfg.recompute}",
            f"data    {s.summary()}",
            f"plan    {self.plan.total_steps} steps x {self.plan.accumulation} x {self.plan.micro_batch} rows x "
            f"{self.plan.sequence_len} = {planned:,} tokens; Chinchilla budget (20 x params) {budget:,} tokens "
            f"({planned / max(budget, 1):.2f}x)",
            f"devices {jax.device_count()} x {jax.devices()[0].device_kind}, mesh {dict(self.mesh.shape)}; "
            f"estimated peak device memory {self.memory_plan.total / 2**30:.1f} GiB",
        ]

    def train(self) -> dict:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        cfg = self.cfg
        for line in self.summary_lines():
            self.console.print(line, highlight=False)
        last: dict = {}
        fields = "loss {task.fields[loss]:.4f} lr {task.fields[lr]:.2e} gnorm {task.fields[gnorm]:.3f} " \
                 "{task.fields[tps]:,.0f} tok/s"
        columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn(fields),
                   TimeRemainingColumn()]
        interactive = self.console.is_terminal
        with Progress(*columns, console=self.console, disable=not interactive) as progress:
            task = progress.add_task("train", total=self.plan.total_steps, completed=self.step_count, loss=float("nan"),
                                     lr=0.0, gnorm=0.0, tps=0.0)
            while self.step_count < self.plan.total_steps:
                try:
                    m = self.step()
                except StopIteration:
                    self.console.print("[yellow]the data ran out before max_steps; stopping[/]")
                    break
                if not math.isfinite(m["loss"]):
                    raise FloatingPointError(f"loss became {m['loss']} at step {self.step_count}")
                progress.update(task, completed=self.step_count, loss=m["loss"], lr=m["lr"], gnorm=m["grad_norm"],
                                tps=m["tokens_per_s"])
                if self.step_count % cfg.logging_steps == 0 or self.step_count in (1, self.plan.total_steps):
                    self.metrics.write(self.step_count, m)
                    if not interactive:
                        self.console.print(f"step {self.step_count}/{self.plan.total_steps} loss {m['loss']:.4f} "
                                           f"lr {m['lr']:.2e} gnorm {m['grad_norm']:.3f} "
                                           f"{m['tokens_per_s']:,.0f} tok/s", highlight=False)
                if cfg.eval_steps and self.step_count % cfg.eval_steps == 0:
                    ev = self.evaluate()
                    if ev is not None:
                        self.metrics.write(self.step_count, {"eval_loss": ev})
                        progress.console.print(f"step {self.step_count}: eval loss {ev:.4f}", highlight=False)
                if cfg.save_steps and self.step_count % cfg.save_steps == 0:
                    self.save_checkpoint()
                last = m
        ev = self.evaluate()
        if ev is not None:
            self.metrics.write(self.step_count, {"eval_loss": ev})
            self.console.print(f"final eval loss {ev:.4f}", highlight=False)
            last["eval_loss"] = ev
        self.checkpointer.close()
        out = self.export()
        chart = plot_loss(self.metrics.history, self.output_dir / "loss.png")
        self.metrics.close()
        self.console.print(f"[bold green]done[/]: {out}" + (f"; loss chart {chart}" if chart else ""))
        return last

    # ---- export ---------------------------------------------------------------------------------------------
    def trained_model(self):
        """The model with the trained weights (a fresh module; the trainer's own state is untouched)."""
        return nnx.merge(self.eval_graphdef, master_params(self.trainable, self.opt_state), self.frozen)

    def export(self, out_dir: str | Path | None = None) -> Path:
        """Write the trained weights: a PEFT adapter (LoRA; plus the merged model with `merge_adapter`) or an
        HF model folder, each with the tokenizer files. Default folder: <output_dir>/adapter or /model."""
        from surojax.weights.hf_checkpoint import copy_tokenizer_files, save_model

        model = self.trained_model()
        save_dtype = jnp.bfloat16 if self.cfg.recipe in ("bf16", "fp8_hybrid") else jnp.float32
        overwrite = bool(self.cfg.resume_from_checkpoint) and out_dir is None
        if self.cfg.lora:
            from surojax.peft.lora import merge_lora
            from surojax.peft.peft_io import save_peft_adapter

            out = save_peft_adapter(model, Path(out_dir or self.output_dir / "adapter"), self.cfg.model,
                                    overwrite=overwrite)
            copy_tokenizer_files(self.tokenizer_dir, out)
            if self.cfg.merge_adapter:
                save_model(merge_lora(model), self.output_dir / "merged", dtype=save_dtype,
                           tokenizer_dir=self.tokenizer_dir, overwrite=overwrite)
            return out
        return save_model(model, Path(out_dir or self.output_dir / "model"), dtype=save_dtype,
                          tokenizer_dir=self.tokenizer_dir, overwrite=overwrite)

