"""The training loop: config -> model + data + optimizer -> steps, evals, checkpoints -> exported artifacts.

    trainer = Trainer(cfg)          # loads everything and checks it fits before the first step
    trainer.step()                  # one optimizer step (A micro-batches), returns its metrics
    trainer.train()                 # the whole run: progress bar, evals, checkpoints, export, loss chart
    trainer.evaluate()              # mean loss over the validation set
    trainer.export()                # PEFT adapter (LoRA; also its two files at the top of output_dir, where
                                    # Surogate writes it) or HF folder (full), with the tokenizer

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

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from surojax.config.schema import TrainConfig
from surojax.config.surogate_defaults import summary_lines as surogate_summary_lines
from surojax.hub import model_path
from surojax.kernel_settings import kernel_settings
from surojax.data.pipeline import build_data_from_config
from surojax.losses.lm import lm_loss
from surojax.data.tokenizer import Tokenizer
from surojax.data.image_batch import ROPE_KEY
from surojax.models.decoder import vision_filter
from surojax.models.layers.attention import packed_backend
from surojax.models.vision.inputs import VisionTokens
from surojax.offload.optimizer import master_params
from surojax.parallel import MeshError, batch_sharding, make_mesh
from surojax.parallel.pipeline import pipeline_stages
from surojax.parallel.distributed import barrier, gather_to_main, global_batch, max_over_processes, row_block
from surojax.peft.lora import merge_lora
from surojax.peft.peft_io import copy_adapter_files, save_peft_adapter
from surojax.peft.trained_router import add_router_to_adapter, has_trained_router
from surojax.quant.base import QuantFormat
from surojax.train.adaptive import AdaptiveSettings, AdaptiveTraining, budget_line, epochs_for_budget, flops_per_token
from surojax.train.build import build_run, count_params, data_parallel_size
from surojax.train.checkpoint_match import CONFIG_META_KEY, check as check_checkpoint, config_record, open_step
from surojax.train.checkpoints import Checkpointer, key_to_array
from surojax.train.image_inputs import (IMAGES_KEY, ImageBatchError, eval_image_batch, is_image_batch,
                                       planned_frame_patches, planned_patches, step_image_batch)
from surojax.train.interrupts import Interrupts
from surojax.train.loop_spec import loop_spec
from surojax.train.metrics import Metrics, plot_loss, set_aside as set_aside_metrics
from surojax.train.notebook_progress import NotebookProgress
from surojax.train.router_monitor import RouterMonitor, progress_text
from surojax.train.run_spec import (TrainSetupError, attention_backend, check_prequantized_base, model_config_for,
                                   run_spec)
from surojax.train.step import compiles_steady_next
from surojax.train.xla_options import apply_xla_options
from surojax.weights.gguf_checkpoint import is_gguf_path, load_gguf_tokenizer
from surojax.weights.gguf_tokenizer import save_tokenizer_dir
from surojax.weights.hf_checkpoint import copy_tokenizer_files, save_model

log = logging.getLogger(__name__)
CHINCHILLA_TOKENS_PER_PARAM = 20


def run_mesh(cfg: TrainConfig):
    """The run's mesh over every visible device (`cfg.mesh_sizes()`). Where the sizes do not fit the devices and
    the config wrote Surogate's `gpus: N` (read as parallel.data), the error says what surojax's reading is."""
    try:
        return make_mesh(cfg.mesh_sizes())  # zero_stage 3 spelled as the fsdp axis
    except MeshError as e:
        if "gpus" not in cfg._surogate_spellings:
            raise
        raise MeshError(f"{e}. gpus: N is read as parallel.data: N over the other sizes, and a run uses every "
                        "visible device (Surogate picks N of them): make N devices visible (CUDA_VISIBLE_DEVICES), "
                        "or write gpus: 0 (all of them)") from None


def _count(state) -> int:
    """Parameters (a quantised weight counts its logical [.., K, N] values, not its packed bytes)."""
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


_DATA_RAN_OUT = object()  # read ahead: the data had no next batch (the step that would take it stops the run)

class Trainer:
    """The training loop of every trainer kind (config key `trainer`): SFT / pretraining here; a post-training
    trainer (surojax/train/trainers.py maps the names) subclasses it and overrides the three task hooks:
    `loss` (the pure loss function build_run compiles), `build_data` (its rows) and `next_batch` (the next
    step's host batch, e.g. made by generation). Checkpoints, resume, metrics, progress and export are shared."""

    loss = staticmethod(lm_loss)

    def __init__(self, cfg: TrainConfig, *, console=None):
        if jax.process_count() > 1 and cfg.trainer != "sft":  # their batches and task state are one-process
            raise TrainSetupError(f"trainer: {cfg.trainer} runs in one process for now; multi-process runs "
                                  "(surojax launch, srun) train sft / pt")
        apply_xla_options([cfg])  # use_cuda_graphs (the CLI has set it before the backend started)
        self.cfg = cfg  # read while the trainer is built; afterwards the loop reads `self.loop` and `self.spec`
        self.loop = loop = loop_spec(cfg)
        # multi-process: process 0 alone prints, writes metrics, the loss chart and the export
        self.is_main = jax.process_index() == 0
        self.console = console or Console(stderr=True)
        if not self.is_main:
            self.console = Console(stderr=True, quiet=True)
        self.output_dir = loop.output.output_dir
        self._check_output_dir()
        model_config = model_config_for(cfg)  # cheap: the architecture is checked before data and weights
        if not cfg.from_scratch:
            check_prequantized_base(cfg)  # likewise what cannot run over a pre-quantised base
        tok_src = cfg.tokenizer or cfg.model
        if tok_src is None:
            raise TrainSetupError("tokenizer: needed when from_scratch has no `model` folder to take it from")
        tok_local = model_path(tok_src, weights=False)  # a folder, a .gguf, a Hub id's head files (or its GGUF)
        if is_gguf_path(tok_local):  # the tokenizer of a GGUF base is in its metadata: export it once, as HF files
            self.tokenizer_dir = self.output_dir / "gguf_tokenizer"
            if self.is_main:
                save_tokenizer_dir(load_gguf_tokenizer(tok_local), self.tokenizer_dir)
            barrier("gguf_tokenizer")
        else:
            self.tokenizer_dir = tok_local
        self.tokenizer = Tokenizer.from_dir(self.tokenizer_dir)

        self.mesh = run_mesh(cfg)
        A, B = loop.batch.accumulation, loop.batch.rows * data_parallel_size(self.mesh)
        self.batch_sharding = NamedSharding(self.mesh, P(None, *batch_sharding(self.mesh).spec))
        self.rows = row_block(self.batch_sharding, (A, B, loop.batch.sequence_len), 1)  # the loaders read this block
        self.data = self.build_data(batch_size=A * B, eval_batch_size=B, num_epochs=loop.length.loader_epochs)
        self.num_params = count_params(model_config)
        num_epochs = loop.length.num_epochs
        if loop.length.epoch_adjustment:  # the Chinchilla budget sets the epochs (the loader above repeats the data)
            log.info("%s", budget_line(self.num_params, max(self.data.stats.tokens, 1)))  # else: the plan line's
            num_epochs = epochs_for_budget(self.num_params, max(self.data.stats.tokens, 1))
            log.info("epoch_adjustment: %d epoch(s) of %s tokens", num_epochs, f"{self.data.stats.tokens:,}")
        if loop.length.max_steps:
            total = loop.length.max_steps
        else:
            total = max(1, int(self.data.train.num_rows * num_epochs // (A * B)))
        self.plan = RunPlan(total, B, A, loop.batch.sequence_len)
        configured = attention_backend(cfg)
        attention = packed_backend(configured, max(
            rows.max_runs for rows in (self.data.train_rows, self.data.eval_rows) if rows is not None))
        if attention != configured:
            log.info("attention: %s (cuDNN over the packed rows, at most %s samples + padding per row)",
                     attention, attention.max_segments)
        self.spec = run_spec(cfg, total_steps=total, attention=attention, model_config=model_config)
        if self.data.stats.images:  # the memory plan counts the tower's activations of the largest micro-batch
            patches = planned_patches((self.data.train_rows, self.data.eval_rows), B,
                                      self._vision_tokens().vision.spatial_merge_size)
            frame = planned_frame_patches((self.data.train_rows, self.data.eval_rows))
            self.spec = self.spec.replace(batch=dataclasses.replace(self.spec.batch, image_patches=patches,
                                                                    image_frame_patches=frame))
        if self.tokenizer.vocab_size > self.spec.model.config.vocab_size:
            raise TrainSetupError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                                  f"{self.spec.model.config.vocab_size}")
        self.run = build_run(self.spec, self.mesh, loss=self.loss)
        self.trainable, self.frozen, self.opt_state = self.run.trainable, self.run.frozen, self.run.opt_state
        self.run.trainable = self.run.frozen = self.run.opt_state = None  # the trainer owns the live state
        self.memory_plan = self.run.memory_plan
        self.key = jax.random.key(loop.seed)
        self.step_count = 0
        self.adaptive = AdaptiveTraining(AdaptiveSettings.from_optim(cfg), flops_per_token=flops_per_token(
            self.num_params))
        self.lr_scale = 1.0  # the loss guard's multiplier of the scheduled learning rate
        moe = self.spec.moe
        self.router_monitor = None if moe is None else RouterMonitor(capacity=moe.capacity_factor is not None)
        self.stop_reason: str | None = None
        self._compiled = False  # whether this process has run (compiled) the train step yet

        self._config_record = config_record(cfg)  # what each checkpoint records of the config (checkpoint_match)
        self._surogate_lines = surogate_summary_lines(cfg)  # the start-up summary's words on the config itself
        self.checkpointer = self._open_checkpointer(loop.output.checkpoint_dir)
        if loop.resuming:
            self._resume()
        if self.step_count == 0 and self.is_main:
            self._set_aside_earlier_metrics()
        ms = loop.metrics
        self.metrics = Metrics(self.output_dir, list(ms.report_to), run_config=cfg.model_dump(by_alias=True),
                               project=ms.project, write=self.is_main, run_name=ms.run_name,
                               wandb_name=ms.wandb_name, aim_experiment=ms.aim_experiment, aim_repo=ms.aim_repo,
                               aim_name=ms.aim_name)

    # ---- set-up helpers -------------------------------------------------------------------------------------
    def _check_output_dir(self) -> None:
        """Refuse to start over what an earlier run left: a trained export (unless resuming), or checkpoints
        (unless resuming them). `--overwrite` (overwrite_output_dir, train/stages.py) clears both first."""
        done = [p for p in (self.output_dir / "model", self.output_dir / "adapter") if p.exists()]
        if done and not self.loop.resuming:
            raise TrainSetupError(f"output_dir: {self.output_dir} already holds a trained {done[0].name} "
                                  f"({done[0]}); choose another output_dir, or pass --overwrite to replace it")
        checkpoints = self.loop.output.checkpoint_dir
        steps = sorted(int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()) if checkpoints.is_dir() else []
        if steps and not self.loop.resuming:
            raise TrainSetupError(f"output_dir: {checkpoints} holds checkpoints up to step {steps[-1]} of an earlier "
                                  "run; continue it with -o resume_from_checkpoint=true, or pass --overwrite to start "
                                  "again")

    def _open_checkpointer(self, directory: Path) -> Checkpointer:
        """The Checkpointer of `directory`, saying which unfinished checkpoint saves (a second Ctrl-C or a kill
        during a save) it found there and removed: they are never resumed from."""
        checkpointer = Checkpointer(directory, keep=self.loop.output.save_total_limit)
        for p in checkpointer.removed_unfinished:
            self.console.print(f"{p}: an unfinished checkpoint (its save was cut off, e.g. by a second Ctrl-C); "
                               "removed", style="yellow", markup=False, highlight=False)
        return checkpointer

    def _set_aside_earlier_metrics(self) -> None:
        """A run starting at step 0 never appends to an earlier run's metrics.jsonl (one that left no whole
        checkpoint to resume): that file is moved aside, and the run says where."""
        moved = set_aside_metrics(self.output_dir / "metrics.jsonl")
        if moved is not None:
            where, steps = moved
            held = f"steps {steps[0]}-{steps[-1]}" if steps else "rows"
            self.console.print(f"{self.output_dir / 'metrics.jsonl'} held {held} of an earlier run with no checkpoint "
                               f"to resume; moved to {where} (this run starts at step 0)", style="yellow",
                               markup=False, highlight=False)

    def _resume(self) -> None:
        """Restore the checkpoint `resume_from_checkpoint` names (a step folder, or true: the latest), after
        checking that it fits this run (train/checkpoint_match.py: a named error, else the changed keys printed)."""
        target = self.loop.resume
        if isinstance(target, str):
            step = open_step(target)
            self.checkpointer.close()
            self.checkpointer = self._open_checkpointer(Path(target).parent)
        else:
            step = self.checkpointer.latest_step()
            if step is None:
                log.warning("resume_from_checkpoint: no checkpoint in %s yet; starting from step 0",
                            self.checkpointer.directory)
                return
        like = self._checkpoint_state()
        for change in check_checkpoint(self.checkpointer, step, self.cfg, like):
            self.console.print(f"changed since the checkpoint's run: {change}", highlight=False, markup=False)
        state, meta = self.checkpointer.restore(step, like)
        self.trainable, self.opt_state = state["trainable"], state["opt_state"]
        self.data.train.set_state(meta["data"])
        self.step_count = int(meta["step"])
        if "adaptive" in meta:
            self.adaptive.load_state_dict(meta["adaptive"])
            self.lr_scale = float(meta["adaptive_lr_scale"])
        self.restore_task_state(state, meta)
        self.console.print(f"[bold]resumed[/] from {self.checkpointer.directory / str(step)} at step {self.step_count}")

    def _checkpoint_state(self) -> dict:
        return {"trainable": self.trainable, "opt_state": self.opt_state, "rng": key_to_array(self.key)}

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.step_count, self._checkpoint_state(),
                               {"step": self.step_count, CONFIG_META_KEY: self._config_record,
                                "data": self._data_state(),
                                "adaptive": self.adaptive.state_dict(), "adaptive_lr_scale": self.lr_scale,
                                **self.task_checkpoint_meta()})

    def task_checkpoint_meta(self) -> dict:
        """Task hook: JSON a post-training trainer adds to each checkpoint's meta (its arrays go into
        `_checkpoint_state`); read back by `restore_task_state`."""
        return {}

    def restore_task_state(self, state: dict, meta: dict) -> None:
        """Task hook: called on resume with the restored state pytree and meta (nothing to do for SFT)."""

    # ---- steps ----------------------------------------------------------------------------------------------
    # ---- task hooks (overridden by post-training trainers) ---------------------------------------------------
    def build_data(self, *, batch_size: int, eval_batch_size: int, num_epochs: int | None):
        """The run's data (surojax/data/pipeline.py `Data`): `batch_size` rows per step (all micro-batches)."""
        return build_data_from_config(self.cfg, self.tokenizer, batch_size=batch_size, seed=self.loop.seed,
                                      num_epochs=num_epochs, eval_batch_size=eval_batch_size,
                                      process_index=self.rows.index, process_count=self.rows.count)

    def next_batch(self) -> dict:
        """The next step's host batch: arrays [A * B, T] the loss reads."""
        return next(self.data.train)

    # Whether the next step's host batch may be read while the current step computes: it must not depend on the
    # step's result (GRPO's rollouts come from the policy the step updates: it turns this off). It is placed on
    # the devices just before its own step's dispatch: placed during the step (while the launches of the step
    # in flight go on) the run measured 2% slower on an H100 (benchmarks/RESULTS.md, session 19).
    prefetch_batches = True
    _prefetched: dict | object | None = None  # the next step's host batch, read ahead (or _DATA_RAN_OUT)
    _prefetched_data_state: dict | None = None  # the train loader's state before that batch was read

    def _prefetch_batch(self) -> None:
        self._prefetched_data_state = self.data.train.get_state()
        try:
            self._prefetched = self.next_batch()
        except StopIteration:  # raised by the next step's read, where the loop expects it, not by this step's
            self._prefetched = _DATA_RAN_OUT

    def _take_batch(self) -> dict:
        batch, self._prefetched, self._prefetched_data_state = self._prefetched, None, None
        if batch is _DATA_RAN_OUT:
            raise StopIteration
        return self._device_batch(batch if batch is not None else self.next_batch())

    def _data_state(self) -> dict:
        """The train loader's position for a checkpoint: before a batch read ahead, which the resumed run reads."""
        return self._prefetched_data_state if self._prefetched is not None else self.data.train.get_state()

    def _device_batch(self, batch: dict) -> dict:
        """This process's rows [A * B / G, T] of the step -> the global batch arrays [A, B, T].

        The loader of row block g of G (`self.rows`; G <= the process count: pipeline stages of one data shard
        share a block) holds rows g, g + G, ... of the global batch, so its micro-batch a (rows a*B/G ..
        (a+1)*B/G of its share) is its part of global micro-batch a: every micro-batch holds the same rows as in
        a one-process run, in another order (the loss sums over rows: equal up to fp32 summation order)."""
        A = self.plan.accumulation
        if is_image_batch(batch):
            return self._device_image_batch(step_image_batch(batch, self._vision_tokens(), A), lead=1)
        shaped = {k: v.reshape(A, v.shape[0] // A, *v.shape[1:]) for k, v in batch.items()}
        return global_batch(shaped, self.batch_sharding, 1, self.rows.count)

    def _vision_tokens(self) -> VisionTokens:
        """The model's image token ids and tower shape (train/image_inputs.py turns image batches with them)."""
        if pipeline_stages(self.mesh) > 1:
            raise ImageBatchError("image rows do not train over pipeline stages (parallel.stage > 1) in this version: "
                                  "the vision tower and its deepstack features run outside the staged layers; use "
                                  "data / fsdp parallelism")
        if self.rows.count > 1:
            raise ImageBatchError("image rows train in one process for now: each process's loader holds other "
                                  "images (multi-process runs: surojax launch, srun); one process over its devices "
                                  "replicates the images and splits the rows")
        return VisionTokens.from_config(self.spec.model.config)

    def _device_image_batch(self, batch: dict, lead: int) -> dict:
        """Image micro-batches (train/image_inputs.py) on the devices: the [.., B, T] arrays split like text rows,
        rope_positions [.., 3, B, T] likewise along B, the images replicated (their rows are not split by row)."""
        rows_spec = batch_sharding(self.mesh).spec  # the [B, T] rule's axes
        lead_axes = (None,) * lead
        images = batch.pop(IMAGES_KEY, None)
        rope = batch.pop(ROPE_KEY)
        out = global_batch(batch, NamedSharding(self.mesh, P(*lead_axes, *rows_spec)), lead, 1)
        out[ROPE_KEY] = jax.device_put(rope, NamedSharding(self.mesh, P(*lead_axes, None, *rows_spec)))
        if images is not None:
            out[IMAGES_KEY] = jax.device_put(images, NamedSharding(self.mesh, P()))
        return out

    def step(self) -> dict:
        """One optimizer step over `gradient_accumulation_steps` micro-batches; returns float metrics.

        The jitted step is dispatched first; while the device computes it, the host evaluates the learning rate
        it logs (numpy) and reads the next step's host batch (`prefetch_batches`); then it waits for the metrics,
        read back in one transfer. Between steps the device waits only for the placement of the batch read
        ahead and the dispatch."""
        t0 = time.perf_counter()
        batch = self._take_batch()
        rng = jax.random.fold_in(self.key, self.step_count)
        self.trainable, self.opt_state, m = self.run.train_step(self.trainable, self.frozen, self.opt_state, batch, rng,
                                                                self.lr_scale)
        lr = float(self.run.lr_at(self.step_count)) * self.lr_scale  # numpy: no device work
        self.step_count += 1
        if self.prefetch_batches and self.step_count < self.plan.total_steps:
            self._prefetch_batch()
        m = jax.device_get(m)  # the one wait for the device, one transfer (the router stats included)
        router = m.pop("router", None)  # a MoE model's RouterStats [L, ...], summed over the micro-batches
        m = {k: float(v) for k, v in m.items()}
        if router is not None:
            m.update(self.router_monitor.observe(self.step_count, router))
        dt = time.perf_counter() - t0
        m.update(lr=lr, step_time=dt, tokens_per_s=self.plan.tokens_per_step / dt)
        self._adapt(self.adaptive.observe(self.step_count, m["loss"], m["grad_norm"], self.plan.tokens_per_step))
        return m

    def _adapt(self, decision) -> None:
        """Apply an adaptive-training decision (surojax/train/adaptive.py): the next steps' learning-rate scale,
        the reason to stop, and its log lines."""
        self.lr_scale = decision.lr_scale
        for event in decision.events:
            log.warning("%s", event)
        if decision.stop is not None and self.stop_reason is None:
            self.stop_reason = decision.stop

    def evaluate(self) -> float | None:
        """Mean loss per supervised token over the whole validation set (None without validation data)."""
        if self.data.eval is None:
            return None
        total, count = 0.0, 0.0
        for batch in self.data.eval:
            if is_image_batch(batch):
                placed = self._device_image_batch(eval_image_batch(batch, self._vision_tokens()), lead=0)
            else:
                placed = global_batch(batch, NamedSharding(self.mesh, P(*self.batch_sharding.spec[1:])), 0,
                                      self.rows.count)
            s, n = self.run.eval_step(self.trainable, self.frozen, placed)
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)

    # ---- the run --------------------------------------------------------------------------------------------
    def summary_lines(self) -> list[str]:
        # full fine-tuning: the frozen state is the vision tower's (frozen unless train_vision), if any
        frozen = self.frozen if self.spec.lora is not None else nnx.filter_state(self.frozen, vision_filter)
        n_total = _count(self.trainable) + _count(frozen)
        n_train = _count(self.trainable)
        planned = self.plan.total_steps * self.plan.tokens_per_step
        budget = CHINCHILLA_TOKENS_PER_PARAM * n_total
        s = self.data.stats
        mode, run_name = self.loop.kind, self.loop.metrics.run_name
        packed = self.spec.model.packed_experts
        return [
            *([f"run     {run_name}"] if run_name else []),
            f"model   {self.spec.model.config.model_type}, {n_total / 1e6:.2f}M parameters, {n_train / 1e6:.3f}M trainable "
            f"({100 * n_train / max(n_total, 1):.2f}%), {mode}, recipe {self.spec.precision.recipe}",
            *([f"base    {packed.describe(self.spec.precision.base)}"] if packed is not None else []),
            *(f"{name:<7} {line}" for name, line in self.run.transform_lines),  # the transforms', in order
            f"layers  {self.run.layer_loop_reason}",
            f"zero    {self.run.zero_summary}",
            f"data    {s.summary()}",
            f"plan    {self.plan.total_steps} steps x {self.plan.accumulation} x {self.plan.micro_batch} rows x "
            f"{self.plan.sequence_len} = {planned:,} tokens; Chinchilla budget (20 x params) {budget:,} tokens "
            f"({planned / max(budget, 1):.2f}x)",
            f"devices {jax.device_count()} x {jax.devices()[0].device_kind}, mesh {dict(self.mesh.shape)}; "
            f"estimated peak device memory {self.memory_plan.total / 2**30:.1f} GiB",
            *self._surogate_lines,  # a Surogate config: the defaults that differ from Surogate's
            *kernel_settings().summary_lines(),  # SUROJAX_* kernel overrides (A/B runs): never silent
        ]

    def train(self, interrupts: Interrupts | None = None) -> dict:
        """The whole run; returns the last logged metrics (+ eval_loss).

        SIGINT / SIGTERM (through `interrupts`, installed here when not given) end the run after the current
        step: a checkpoint at that step is written and waited for, the loader, checkpointer and metrics are
        closed, and nothing is exported (`interrupts.exit_code` says 130 / 143). See train/interrupts.py."""
        if interrupts is None:
            with Interrupts() as own:
                return self.train(own)
        try:
            return self._train(interrupts)
        finally:
            self.close()

    def _train(self, interrupts: Interrupts) -> dict:
        loop, cadence = self.loop, self.loop.cadence
        if loop.resuming:  # the rows after the resumed step are written again: none twice
            self.metrics.truncate_after(self.step_count)
        self.console.print("\n".join(self.summary_lines()), highlight=False)  # one output in a notebook
        last: dict = {}
        fields = "loss {task.fields[loss]:.4f} lr {task.fields[lr]:.2e} gnorm {task.fields[gnorm]:.3f} " \
                 "{task.fields[tps]:,.0f} tok/s{task.fields[router]}"
        columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn(fields),
                   TimeRemainingColumn()]
        # a terminal: rich's live bar; a notebook: one output updated in place; a log file / pipe: a line per log
        notebook = self.console.is_jupyter and not self.console.quiet
        interactive = self.console.is_terminal or notebook
        with (NotebookProgress(*columns, console=self.console) if notebook else
              Progress(*columns, console=self.console, disable=not interactive)) as progress:
            task = progress.add_task("train", total=self.plan.total_steps, completed=self.step_count, loss=float("nan"),
                                     lr=0.0, gnorm=0.0, tps=0.0, router="")
            while self.step_count < self.plan.total_steps and not self._stop_requested(interrupts):
                try:
                    compiles = self._compiled is False
                    m = self.step()
                except StopIteration:
                    self.console.print("[yellow]the data ran out before max_steps; stopping[/]")
                    break
                if compiles:
                    self._compiled = True
                    again = ("; fp8 delayed scaling compiles its steady program (the histories' scales) in the "
                             "next step" if compiles_steady_next(self.run.train_step) else "")
                    progress.console.print(f"first step {m['step_time']:.1f} s (compiling the step included{again})",
                                           highlight=False)
                if not math.isfinite(m["loss"]) and loop.stop_on_nonfinite_loss:
                    raise FloatingPointError(f"loss became {m['loss']} at step {self.step_count} (auto_lr_reduction: "
                                             "true skips such steps and lowers the learning rate)")
                router = f" {progress_text(m)}" if "router_aux_loss" in m else ""
                progress.update(task, completed=self.step_count, loss=m["loss"], lr=m["lr"], gnorm=m["grad_norm"],
                                tps=m["tokens_per_s"], router=router)
                if cadence.logs(self.step_count, self.plan.total_steps):
                    self.metrics.write(self.step_count, m)
                    if not interactive:
                        self.console.print(f"step {self.step_count}/{self.plan.total_steps} loss {m['loss']:.4f} "
                                           f"lr {m['lr']:.2e} gnorm {m['grad_norm']:.3f} "
                                           f"{m['tokens_per_s']:,.0f} tok/s{router}", highlight=False)
                if cadence.evaluates(self.step_count) and not self._stop_requested(interrupts):
                    ev = self.evaluate()
                    if ev is not None:
                        self.metrics.write(self.step_count, {"eval_loss": ev})
                        progress.console.print(f"step {self.step_count}: eval loss {ev:.4f}", highlight=False)
                        self._adapt(self.adaptive.observe_eval(self.step_count, ev))
                if cadence.saves(self.step_count):
                    self.console.print(f"saving checkpoint {self.step_count}", highlight=False)
                    self.save_checkpoint()
                last = m
                if self.stop_reason is not None:
                    self.console.print(f"[yellow]early_stop: stopping at step {self.step_count} "
                                       f"({self.stop_reason})[/]")
                    if not cadence.saves(self.step_count):
                        self.save_checkpoint()
                    break
        if self._stop_requested(interrupts):
            self._checkpoint_interrupted(interrupts)
            return last
        ev = self.evaluate()
        if ev is not None:
            self.metrics.write(self.step_count, {"eval_loss": ev})
            self.console.print(f"final eval loss {ev:.4f}", highlight=False)
            last["eval_loss"] = ev
        self.checkpointer.close()
        out = self.export(overwrite=loop.resuming)
        chart = plot_loss(self.metrics.history, self.output_dir / "loss.png") if self.is_main else None
        self.metrics.close()
        self.console.print(f"[bold green]done[/]: {out}" + (f"; loss chart {chart}" if chart else ""))
        return last

    def _stop_requested(self, interrupts: Interrupts) -> bool:
        """Whether to stop at this step boundary. Multi-process: a signal any process got stops them all at the
        same step (one small all-gather), and one that has not had it yet takes it on (its exit code included)."""
        signum = max_over_processes(interrupts.signum or 0)
        if signum and interrupts.signum is None:
            interrupts.signum = signum
        return bool(signum)

    def _checkpoint_interrupted(self, interrupts: Interrupts) -> None:
        """After SIGINT / SIGTERM: a whole checkpoint at the current step (unless one is there already)."""
        if self.step_count == 0:
            self.console.print(f"[yellow]{interrupts.name}: stopped before the first step; nothing to save[/]")
            return
        if self.checkpointer.latest_step() != self.step_count:
            self.save_checkpoint()
        self.checkpointer.wait()
        self.console.print(f"[yellow]{interrupts.name}[/]: stopped at step {self.step_count}/{self.plan.total_steps}; "
                           f"checkpoint {self.checkpointer.directory / str(self.step_count)}", highlight=False)

    def close(self) -> None:
        """Wait for checkpoint writes, stop the data loader's threads, close the metrics sinks (idempotent).
        Leaving these running when the interpreter exits is what aborted interrupted runs (interrupts.py)."""
        self.checkpointer.close()
        self.data.train.close()
        self.metrics.close()

    # ---- export ---------------------------------------------------------------------------------------------
    def trained_model(self):
        """The model with the trained weights (a fresh module; the trainer's own state is untouched)."""
        # copy: new Variables over the same arrays, so merge_lora's in-place fold (merge_adapter) cannot write
        # into the trainer's frozen state
        return nnx.merge(self.run.eval_graphdef, master_params(self.trainable, self.opt_state), self.frozen,
                         copy=True)

    def export(self, out_dir: str | Path | None = None, *, overwrite: bool = False) -> Path:
        """Write the trained weights: a PEFT adapter (LoRA; plus the merged model with `merge_adapter`) or an
        HF model folder, each with the tokenizer files. Default folder: <output_dir>/adapter or /model.
        An existing non-empty folder is an error unless `overwrite` (writes are atomic: temp folder + rename).
        Multi-process: every process calls it (the weights are all-gathered, surojax.parallel.distributed
        `gather_to_main`); process 0 alone writes, the others return the same path."""
        model = self.trained_model()
        if jax.process_count() > 1:
            graphdef, state = nnx.split(model)
            state = gather_to_main(state)
            if state is None:
                return Path(out_dir or self.output_dir / ("adapter" if self.spec.lora is not None else "model"))
            model = nnx.merge(graphdef, state)
        save_dtype = self.spec.precision.save_dtype
        lora = self.spec.lora
        if lora is not None:
            out = save_peft_adapter(model, Path(out_dir or self.output_dir / "adapter"), self.loop.output.base_model,
                                    overwrite=overwrite)
            if has_trained_router(model):  # train_router: the routers as PEFT modules_to_save
                add_router_to_adapter(model, out)
            copy_tokenizer_files(self.tokenizer_dir, out)
            if out_dir is None:  # also where Surogate writes it: output_dir itself (merge --checkpoint-dir output)
                copy_adapter_files(out, self.output_dir)
            if lora.merge_adapter:
                save_model(merge_lora(model), self.output_dir / "merged", dtype=save_dtype,
                           tokenizer_dir=self.tokenizer_dir, overwrite=overwrite)
            return out
        return save_model(model, Path(out_dir or self.output_dir / "model"), dtype=save_dtype,
                          tokenizer_dir=self.tokenizer_dir, overwrite=overwrite)

