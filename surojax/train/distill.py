"""Knowledge distillation (`trainer: distill`): the SFT loop with the teacher's top-K log-probs in every batch.

    surojax distill CONFIG                  # teacher online: a frozen, jitted teacher forward per batch
    surojax distill CONFIG --precompute     # write the teacher sidecar once (train/teacher_sidecar.py)
    surojax distill CONFIG -o teacher_logprobs=out/teacher_logprobs   # train from it; the teacher is never loaded

The student is the run's `model` (full, LoRA or QLoRA, as any run). The teacher's top-K ids and log-probs join the
host batch in `next_batch` (and each validation batch), so the compiled step stays the generic one and the loss
(surojax/losses/distill.py) reads them like the labels; an online teacher and its sidecar give the student the
same batches.

The online teacher is placed and planned like a model of the run (surojax/train/teacher_topk.py): its weights are
loaded into host memory, counted per device as the run's mesh will hold them (the student's parameter rules: fsdp /
tensor splits; quantised kernels, GGUF's too, at their packed size) plus the peak of its forward over one
micro-batch (its top-K in sequence chunks), added to the student's memory plan (surojax/offload/device_budget.py:
the weights stay resident, the forward runs between steps) and checked against the device before they are placed
on the mesh: a run whose student + teacher do not fit is refused before the first step, naming the teacher and
its size (on a mesh that shards the parameters, where build_run does not check the student's one-device plan, the
teacher is checked alone). The start-up summary states the teacher's size. Its forward is one jit over the mesh, its rows split like the student's batch.

metrics.jsonl adds per step: `kl` (mean KL(teacher || student) per supervised token, at `temperature`, before
alpha and T^2) and `ce` (mean CE on the labels); `loss` = alpha * T^2 * kl + (1 - alpha) * ce.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from surojax.config.schema import TrainConfig
from surojax.data.pipeline import build_data_from_config
from surojax.data.tokenizer import Tokenizer
from surojax.hub import model_path
from surojax.losses.distill import distill_loss
from surojax.models.layers.attention import packed_backend
from surojax.offload.device_budget import Beside, check_beside, plans_one_device
from surojax.offload.memory_plan import device_capacity
from surojax.parallel import batch_parallel_size
from surojax.precision.recipe import Recipe
from surojax.train.run_spec import TrainSetupError, attention_backend
from surojax.train.teacher_sidecar import SidecarTeacher, write_teacher_sidecar
from surojax.train.teacher_topk import OnlineTeacher, check_same_vocabulary, teacher_tokenizer
from surojax.train.trainer import Trainer, run_mesh
from surojax.weights.gguf_checkpoint import is_gguf_path, load_gguf_tokenizer

log = logging.getLogger(__name__)
SIDECAR_NAME = "teacher_logprobs"  # the sidecar's folder under output_dir when `teacher_logprobs` is not set


def teacher_dtype(recipe: str | Recipe):
    """The teacher's weight and compute dtype: the recipe's compute dtype (fp32 runs keep fp32, every other recipe
    runs the teacher in bf16)."""
    return Recipe(recipe).compute_dtype


def sidecar_path(cfg: TrainConfig) -> Path:
    """Where --precompute writes the sidecar: `teacher_logprobs`, else <output_dir>/teacher_logprobs."""
    return Path(cfg.teacher_logprobs or Path(cfg.output_dir) / SIDECAR_NAME)


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """The distillation keys, read once: the teacher (a model reference, or the sidecar of its log-probs), its
    top-K, the loss's KL weight alpha and temperature."""

    teacher: str | None
    teacher_logprobs: str | None  # a sidecar written by --precompute (None: the teacher runs online)
    top_k: int
    alpha: float
    temperature: float

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> DistillSpec:
        return cls(cfg.teacher, cfg.teacher_logprobs, cfg.teacher_top_k, cfg.alpha, cfg.temperature)


class DistillTrainer(Trainer):
    """The Trainer with the distillation loss; each batch gets `teacher_ids` / `teacher_logps` [A * B, T, K] from
    the online teacher or the sidecar (`self.teacher`, either has `topk(batch)`)."""

    peak_memory: int | None = None  # an online teacher's run: the peak bytes per device checked at start-up

    def __init__(self, cfg: TrainConfig, *, console=None):
        if cfg.trainer != "distill":
            raise TrainSetupError(f"DistillTrainer runs trainer: distill configs (got trainer: {cfg.trainer})")
        self.distill = d = DistillSpec.from_config(cfg)
        # an instance attribute in place of the class's staticmethod: build_run compiles this loss
        self.loss = functools.partial(distill_loss, alpha=d.alpha, temperature=d.temperature)
        super().__init__(cfg, console=console)
        seq = self.loop.batch.sequence_len
        if d.teacher_logprobs is not None:
            self.teacher = SidecarTeacher.open(d.teacher_logprobs, self.tokenizer, top_k=d.top_k, sequence_len=seq,
                                               teacher=d.teacher)
        else:
            try:
                self.teacher = OnlineTeacher.load(
                    d.teacher, self.tokenizer, top_k=d.top_k, mesh=self.mesh, rows=self.plan.micro_batch,
                    sequence_len=seq, dtype=teacher_dtype(self.spec.precision.recipe),
                    attention=self.spec.model.attention, chunk=self.run.chunk, admit=self._admit_teacher)
            except BaseException:
                self.close()  # a refused teacher: stop the data loader's threads the Trainer started
                raise

    def _admit_teacher(self, teacher: Beside) -> None:
        """The student's plan + the online teacher must fit the device together (MemoryPlanError otherwise). On a
        mesh that shards the parameters the student's plan (one device holding all of it) only bounds it from
        above, and build_run does not check it: there the teacher is checked alone."""
        plan = self.memory_plan if plans_one_device(self.mesh) else None
        self.peak_memory = check_beside(plan, [teacher], device_capacity())

    def summary_lines(self) -> list[str]:
        source = (f"sidecar {self.teacher.path} (written by {self.teacher.meta['teacher']})"
                  if isinstance(self.teacher, SidecarTeacher) else
                  f"{self.teacher.name}, online, {self.teacher.memory.detail} per device")
        d = self.distill
        return [*super().summary_lines(), f"teacher {source}; top-{d.top_k} KL x alpha "
                f"{d.alpha} + CE x {1 - d.alpha:g}, temperature {d.temperature:g}"]

    def build_data(self, *, batch_size: int, eval_batch_size: int, num_epochs: int | None):
        """The SFT data; an online teacher's tokenizer is checked against the student's first (before weights)."""
        if self.distill.teacher_logprobs is None:
            check_same_vocabulary(teacher_tokenizer(self.distill.teacher), self.tokenizer, self.distill.teacher)
        return text_rows_only(super().build_data(batch_size=batch_size, eval_batch_size=eval_batch_size,
                                                 num_epochs=num_epochs))

    def next_batch(self) -> dict:
        batch = super().next_batch()
        return batch | self.teacher.topk(batch)

    def step(self) -> dict:
        m = super().step()
        count = max(m["tokens"], 1.0)
        m["kl"], m["ce"] = m["kl"] / count, m["ce"] / count  # the step sums them: means per supervised token
        return m

    def evaluate(self) -> float | None:
        """Mean distillation loss per supervised token over the validation set (None without validation data)."""
        if self.data.eval is None:
            return None
        sharding = NamedSharding(self.mesh, P(*self.batch_sharding.spec[1:]))
        total, count = 0.0, 0.0
        for batch in self.data.eval:
            batch = batch | self.teacher.topk(batch)
            s, n = self.run.eval_step(self.trainable, self.frozen, jax.device_put(batch, sharding))
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)


def student_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """The run's tokenizer (`tokenizer`, else the student `model`'s; a GGUF's from its metadata)."""
    src = cfg.tokenizer or cfg.model
    if src is None:
        raise TrainSetupError("tokenizer: needed when from_scratch has no `model` folder to take it from")
    local = model_path(src, weights=False)  # a folder, a .gguf, a Hub id's head files (or its GGUF)
    return load_gguf_tokenizer(local) if is_gguf_path(local) else Tokenizer.from_dir(local)


def text_rows_only(data):
    """The data, refused by name when it holds images: the teacher's log-probs are of text rows (sidecar and online
    teacher alike; its forward pass takes no images in this version)."""
    if data.stats.images:
        data.train.close()
        raise TrainSetupError(f"trainer: distill trains on text rows only in this version; the data holds "
                              f"{data.stats.images} images (image rows train with trainer: sft)")
    return data


def precompute_teacher_logprobs(cfg: TrainConfig, out: str | Path | None = None, *, dtype: str = "float16") -> Path:
    """Tokenize the config's data as the run does and write the teacher's top-K log-probs of every training and
    validation row to the sidecar `out` (default `sidecar_path(cfg)`); the student is never built."""
    if cfg.teacher is None:
        raise TrainSetupError("teacher: --precompute runs the teacher; set `teacher`")
    tokenizer = student_tokenizer(cfg)
    data = text_rows_only(build_data_from_config(cfg, tokenizer, batch_size=1, seed=cfg.seed, num_epochs=1,
                                                 eval_batch_size=1))
    try:
        row_sets = [r for r in (data.train_rows, data.eval_rows) if r is not None]
        attention = packed_backend(attention_backend(cfg), max(r.max_runs for r in row_sets))
        mesh = run_mesh(cfg)
        capacity = device_capacity()
        teacher = OnlineTeacher.load(cfg.teacher, tokenizer, top_k=cfg.teacher_top_k, mesh=mesh,
                                     rows=cfg.per_device_train_batch_size * batch_parallel_size(mesh),
                                     sequence_len=cfg.sequence_len, dtype=teacher_dtype(cfg.recipe),
                                     attention=attention, admit=lambda m: check_beside(None, [m], capacity))
        rows = [row for r in row_sets for row in (r[i] for i in range(len(r)))]
        log.info("teacher %s: top-%d log-probs of %d rows", cfg.teacher, cfg.teacher_top_k, len(rows))
        return write_teacher_sidecar(out or sidecar_path(cfg), rows, teacher, tokenizer=tokenizer,
                                     sequence_len=cfg.sequence_len, dtype=dtype)
    finally:
        data.train.close()
