"""The GRPO trainer (`trainer: grpo`): rollouts on the co-located serving engine, rewards, the clipped policy loss.

One generation batch every `num_iterations` optimizer steps:

    P = rows per step / num_generations prompts (PromptOrder: a function of seed + generation index)
      -> G completions each on the serving Engine over the trainer's CURRENT weights (grpo_rollout.Rollout)
      -> rewards (surojax/train/rewards.py) -> group advantages (surojax/losses/grpo.py)
      -> old log-probs (num_iterations > 1: one forward of the policy before its updates; with one iteration the
         loss uses its own detached log-probs, TRL's rule) and reference log-probs (beta > 0, below)
      -> num_iterations optimizer steps on that batch through the Trainer's compiled step (build_run(loss=grpo_loss))

The rows of a step are the run's A x B rows (gradient_accumulation_steps x per_device_train_batch_size x data
parallel), one prompt + completion each; num_generations must divide them. sequence_len bounds prompt +
completion: prompts longer than sequence_len - max_completion_length are dropped at load.

Sampler state and resume: the prompts of generation g and the seeds of its requests are functions of (seed, g);
the trainer checkpoints g (the data state) and the generation batch still being trained on (num_iterations > 1),
so a run resumed from any step repeats the uninterrupted run.

The KL reference (beta > 0): with LoRA, the base with the adapter switched off (no copy); under full fine-tuning,
a frozen copy of the INITIAL trainable weights kept on the device (`reference_copy`), sharded like the parameters.
Each matrix is stored in the compute dtype every forward casts it to at use (bf16 for a bf16 recipe: not the fp32
master), so the reference forward computes the initial policy's values (the same casts); vectors (norm scales,
biases, attention sinks, router biases: a few KiB) keep their storage dtype, as some are read in fp32. (Under
fp8_hybrid the FP8 layers then quantise from the bf16 copy rather than the fp32 master: the initial model up to
that rounding.) On resume the copy is taken before the checkpoint replaces the weights (as DPO's reference pass),
so it is the initial model again.

Memory: the engine's KV pool is sized for one generation batch at once (grpo_rollout.kv_blocks) and, with the full
fine-tuning reference copy, added to the training memory plan; a run whose sum exceeds the device is refused before
the first step, naming what does not fit.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from surojax.config.schema import TrainConfig
from surojax.config.policy_loss import resolved_beta, resolved_loss_type
from surojax.data.pipeline import DataStats
from surojax.data.prompts import Prompt, PromptData, PromptOrder, load_prompts
from surojax.losses.grpo import (METRIC_DENOMINATORS, GRPOLossSettings, ScaleRewards, group_advantages, grpo_loss,
                                  mean_metrics)
from surojax.losses.token_logps import model_target_logps
from surojax.models.layers.params import logical_axes
from surojax.offload.device_budget import Beside, check_beside
from surojax.offload.memory_plan import device_capacity
from surojax.peft.lora import lora_modules
from surojax.train.grpo_rollout import Completion, Rollout, RolloutSettings, completion_rows, kv_bytes
from surojax.train.rewards import RewardSettings, compute_rewards, load_reward_functions
from surojax.train.run_spec import TrainSetupError
from surojax.train.trainer import Trainer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerationBatch:
    """A generation batch on the host: the loss's rows (dict of [R, T] / [R] arrays), its metrics, and how many
    optimizer steps still train on it."""

    rows: dict
    metrics: dict
    remaining: int


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """How each generation batch is made, read once from the config: G completions per prompt, trained on for
    num_iterations steps; sampling; the rewards' weights and scaling; the rows' length."""

    num_generations: int
    num_iterations: int
    seed: int
    sequence_len: int
    max_completion_length: int
    temperature: float
    top_p: float
    reward_weights: tuple[float, ...] | None
    scale_rewards: ScaleRewards
    mask_truncated_completions: bool

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> GenerationSpec:
        return cls(cfg.num_generations, cfg.num_iterations, cfg.seed, cfg.sequence_len, cfg.max_completion_length,
                   cfg.temperature, cfg.top_p, None if cfg.reward_weights is None else tuple(cfg.reward_weights),
                   cfg.scale_rewards, cfg.mask_truncated_completions)


def _reference_dtype(variable: nnx.Variable, compute_dtype):
    """The dtype a full fine-tuning reference keeps `variable` in: the compute dtype for a floating matrix (two or
    more axes besides `layers`: every forward casts it to the compute dtype at use), else its own dtype."""
    x = variable.get_value()
    matrix = sum(a != "layers" for a in logical_axes(variable)) >= 2
    return jnp.dtype(compute_dtype) if matrix and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype


def reference_copy(trainable: nnx.State, compute_dtype) -> nnx.State:
    """A frozen copy of `trainable` on the devices (new buffers, each with its parameter's NamedSharding), matrices
    in `compute_dtype` (`_reference_dtype`): the KL reference of a full fine-tuning run."""
    leaves, treedef = jax.tree.flatten(trainable)
    dtypes = jax.tree.leaves(jax.tree.map(lambda v: _reference_dtype(v, compute_dtype), trainable,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable)))
    copy = jax.jit(lambda xs: [jnp.array(x, dtype=d, copy=True) for x, d in zip(xs, dtypes)],
                   out_shardings=[x.sharding for x in leaves])
    return jax.tree.unflatten(treedef, copy(leaves))


def reference_bytes(trainable: nnx.State, compute_dtype) -> int:
    """Bytes one device holds of `reference_copy(trainable, compute_dtype)` (its shard of each leaf)."""
    def nbytes(v):
        x = v.get_value()
        return math.prod(x.sharding.shard_shape(x.shape)) * _reference_dtype(v, compute_dtype).itemsize

    return sum(jax.tree.leaves(jax.tree.map(nbytes, trainable, is_leaf=lambda x: isinstance(x, nnx.Variable))))


def rollout_besides(kv: int, reference: int, *, blocks: int, rows: int, sequence_len: int) -> list[Beside]:
    """What a GRPO run keeps on the device beside its training step (bytes per device): the rollout KV pool and,
    for beta > 0 under full fine-tuning, the KL reference copy of the initial weights."""
    out = [Beside("rollout KV pool", resident=kv, detail=f"{blocks} blocks for {rows} rows of {sequence_len} tokens",
                  hint="lower per_device_train_batch_size or sequence_len")]
    if reference:
        out.append(Beside("KL reference copy", resident=reference,
                          detail="the initial weights, kept for beta > 0 under full fine-tuning",
                          hint="or drop the reference copy: beta: 0 (TRL's default), LoRA (its reference is the "
                               "base without the adapter, no copy) or more devices (fsdp)"))
    return out


def adapter_off(model) -> None:
    """Switch every LoRA adapter of `model` off (scaling 0): the reference policy of a LoRA run is its base."""
    for module in lora_modules(model).values():
        module.scaling = 0.0


class GRPOTrainer(Trainer):
    """Trainer with GRPO's three hooks: `loss` (grpo_loss with the config's settings), `build_data` (the prompts)
    and `next_batch` (a generation batch made every num_iterations steps)."""

    prefetch_batches = False  # the rollouts come from the policy the running step updates: read after it

    def __init__(self, cfg: TrainConfig, **kwargs):
        self.settings = GRPOLossSettings(loss_type=resolved_loss_type(cfg), epsilon=cfg.epsilon,
                                         epsilon_high=cfg.epsilon_high, beta=resolved_beta(cfg),
                                         max_completion_length=cfg.max_completion_length, temperature=cfg.temperature)
        self.loss = functools.partial(grpo_loss, settings=self.settings)  # build_run compiles this
        if self.settings.beta > 0 and cfg.train_router:
            raise TrainSetupError("beta: the reference of a LoRA run is the base without the adapter, but "
                                  "train_router changes the base's routers; use beta: 0 or train_router: false")
        if cfg.offload_base_weights:
            raise TrainSetupError("offload_base_weights: the rollout engine reads the base weights on the device; GRPO "
                                  "cannot stream them from host memory in this version")
        self._pending: GenerationBatch | None = None
        self._reference: nnx.State | None = None  # full fine-tuning with beta > 0: the initial weights (copy)
        self.generation = gen = GenerationSpec.from_config(cfg)
        super().__init__(cfg, **kwargs)
        self.reward_functions = load_reward_functions(cfg.reward_functions, RewardSettings.from_config(cfg))
        rows = self.plan.accumulation * self.plan.micro_batch
        eos = self.tokenizer.eos_token_id
        self.rollout = Rollout(self._live_model(), None, RolloutSettings(
            max_completion_length=gen.max_completion_length, temperature=gen.temperature, top_p=gen.top_p,
            stop_token_ids=() if eos is None else (eos,)), rows=rows, sequence_len=gen.sequence_len)
        self._plan_kv()
        self._keep_reference()  # (already kept by _resume when resuming)
        graphdef, chunk, temp = self.run.eval_graphdef, self.run.chunk, gen.temperature

        def policy(trainable, frozen, batch):
            return model_target_logps(nnx.merge(graphdef, trainable, frozen), batch, chunk=chunk, temperature=temp)

        def base(trainable, frozen, batch):  # LoRA: the reference is the base, the adapter off
            model = nnx.merge(graphdef, trainable, frozen, copy=True)
            adapter_off(model)
            return model_target_logps(model, batch, chunk=chunk, temperature=temp)

        self._policy_logps = jax.jit(policy)
        # full fine-tuning: the policy's forward over the reference copy (called with it in place of `trainable`)
        self._reference_logps = self._policy_logps if self._reference is not None else jax.jit(base)
        if self._restored_pending is not None:
            self._pending = self._restored_pending

    _restored_pending: GenerationBatch | None = None

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _live_model(self):
        """The trainer's current weights as a model: new Variables over the trainer's own arrays (no copy)."""
        return nnx.merge(self.run.eval_graphdef, self.trainable, self.frozen)

    @property
    def _needs_reference_copy(self) -> bool:
        return self.settings.beta > 0 and self.spec.lora is None

    def _plan_kv(self) -> None:
        """Training memory + the engine's KV pool and state slots (+ the full fine-tuning reference copy) must fit the device
        together (surojax/offload/device_budget.py)."""
        cfg = self.spec.model.config
        runner = self.rollout.engine.runner  # a hybrid model's state slots count with the pool
        kv = kv_bytes(cfg, self.rollout.num_blocks, jax.tree.leaves(runner.k_pool)[0].dtype) \
            + sum(x.nbytes for x in jax.tree.leaves(runner.state_pool))
        ref = reference_bytes(self.trainable, self.spec.precision.compute) if self._needs_reference_copy else 0
        check_beside(self.memory_plan, rollout_besides(kv, ref, blocks=self.rollout.num_blocks,
                                                       rows=self.plan.accumulation * self.plan.micro_batch,
                                                       sequence_len=self.generation.sequence_len), device_capacity())

    def _keep_reference(self) -> None:
        """Full fine-tuning with beta > 0: copy the current (initial) trainable weights as the KL reference, once."""
        if self._needs_reference_copy and self._reference is None:
            self._reference = reference_copy(self.trainable, self.spec.precision.compute)

    def _resume(self) -> None:
        self._keep_reference()  # the initial weights, before the checkpoint replaces them
        super()._resume()

    def build_data(self, *, batch_size: int, eval_batch_size: int, num_epochs: int | None) -> PromptData:
        cfg, gen = self.cfg, self.generation  # the prompts' keys: read here, while the trainer is built
        G = gen.num_generations
        if batch_size % G:
            raise TrainSetupError(f"num_generations: {G} must divide the rows of a step ({batch_size} = "
                                  "gradient_accumulation_steps x per_device_train_batch_size x data parallel)")
        if cfg.validation_datasets or cfg.validation_split_ratio:
            raise TrainSetupError("validation_datasets: GRPO has no validation loss in this version; remove them")
        stats = DataStats(sequence_len=gen.sequence_len)
        prompts = load_prompts(cfg.datasets, self.tokenizer, max_prompt_len=gen.sequence_len - gen.max_completion_length,
                               skip_invalid_rows=cfg.skip_invalid_rows, chat_template=cfg.chat_template, stats=stats)
        stats.rows = len(prompts)
        order = PromptOrder(len(prompts), batch_size // G, seed=gen.seed, num_epochs=num_epochs,
                            rows_per_prompt=G * gen.num_iterations)
        return PromptData(prompts=prompts, train=order, stats=stats)

    # ---- one generation batch ------------------------------------------------------------------------------
    def _generate(self) -> GenerationBatch:
        gen = self.generation
        G = gen.num_generations
        generation = self.data.train.generation
        prompts: list[Prompt] = [self.data.prompts[i] for i in self.data.train.next()]
        t0 = time.perf_counter()
        self.rollout.set_weights(self._live_model())
        prompt_ids = [p.ids for p in prompts for _ in range(G)]
        seeds = np.random.default_rng([gen.seed, generation]).integers(0, 2**32, size=len(prompt_ids))
        completions = self.rollout.generate(prompt_ids, seeds)
        generation_time = time.perf_counter() - t0

        total, per_function = compute_rewards(
            self.reward_functions, gen.reward_weights, [p.prompt for p in prompts for _ in range(G)],
            [self._completion_value(p, c) for p, c in zip((p for p in prompts for _ in range(G)), completions)],
            {k: [p.columns.get(k) for p in prompts for _ in range(G)] for k in _column_names(prompts)})
        total = np.asarray(total, np.float32)
        rows = completion_rows(prompt_ids, completions, gen.sequence_len,
                               mask_truncated=gen.mask_truncated_completions)
        rows["advantages"] = np.asarray(group_advantages(jnp.asarray(total), G, gen.scale_rewards), np.float32)
        t1 = time.perf_counter()
        device = self._device_batch_flat(rows)
        if gen.num_iterations > 1:
            rows["old_logps"] = self._micro_logps(self._policy_logps, device)
        if self.settings.beta > 0:
            rows["ref_logps"] = self._micro_logps(self._reference_logps, device, self._reference)
        lengths = np.array([len(c.ids) for c in completions], np.float32)
        metrics = {"reward": float(total.mean()), "reward_std": float(total.std()),
                   **{f"reward/{name}": float(np.nanmean(np.asarray(v, np.float32)))
                      for name, v in per_function.items()},
                   "completion_length": float(lengths.mean()),
                   "truncated_ratio": float(np.mean([c.truncated for c in completions])),
                   "generation_time": generation_time, "reference_time": time.perf_counter() - t1}
        return GenerationBatch(rows, metrics, gen.num_iterations)

    def _completion_value(self, prompt: Prompt, completion: Completion):
        """What reward functions receive: the text (string prompts) or [{"role": "assistant", "content": text}]
        (conversational prompts), TRL's forms."""
        text = self.tokenizer.decode(completion.ids, skip_special_tokens=True)
        return text if isinstance(prompt.prompt, str) else [{"role": "assistant", "content": text}]

    def _device_batch_flat(self, rows: dict) -> dict:
        """The rows as the forward reads them: [A, B, T] on the batch sharding (one micro-batch per call)."""
        return self._device_batch({k: rows[k] for k in ("tokens", "positions", "segment_ids", "targets")})

    def _micro_logps(self, fn, device: dict, weights: nnx.State | None = None) -> np.ndarray:
        """fn(weights or the trainable weights, frozen, micro-batch) over each micro-batch of the [A, B, T] device
        batch -> [A * B, T] host log-probs."""
        weights = self.trainable if weights is None else weights
        out = [fn(weights, self.frozen, {k: v[a] for k, v in device.items()}) for a in range(self.plan.accumulation)]
        return np.concatenate([np.asarray(jax.device_get(o)) for o in out]).astype(np.float32)

    def _device_batch(self, batch: dict) -> dict:
        """[A * B, ...] host rows -> [A, B, ...] on the batch sharding ([R] advantages too: rank 2, [A, B])."""
        A, B = self.plan.accumulation, self.plan.micro_batch
        spec = self.batch_sharding.spec  # (None, batch axes, None) for [A, B, T]
        return {k: jax.device_put(v.reshape(A, B, *v.shape[1:]), NamedSharding(self.mesh, P(*spec[:v.ndim + 1])))
                for k, v in batch.items()}

    # ---- Trainer hooks --------------------------------------------------------------------------------------
    def next_batch(self) -> dict:
        if self._pending is None or self._pending.remaining == 0:
            self._pending = self._generate()
        self._pending = dataclasses.replace(self._pending, remaining=self._pending.remaining - 1)
        self._step_metrics = self._pending.metrics
        return self._pending.rows

    def step(self) -> dict:
        self._step_metrics = {}
        m = super().step()
        sums = {k: m.pop(k) for k in ("completion_tokens", "sequences", "clip_count", *METRIC_DENOMINATORS)}
        means = {k: float(v) for k, v in mean_metrics(sums).items()}
        if self.settings.beta == 0:  # no reference pass: no KL to report (TRL logs none either)
            means.pop("kl")
        m.update(means, clip_ratio=means["clip_ratio/region_mean"])
        gen = self._step_metrics
        fresh = self._pending is not None and self._pending.remaining == self.generation.num_iterations - 1
        m.update({k: v for k, v in gen.items() if not k.endswith("_time")})
        m["generation_time"] = gen.get("generation_time", 0.0) if fresh else 0.0
        m["reference_time"] = gen.get("reference_time", 0.0) if fresh else 0.0
        m["training_time"] = m["step_time"] - m["generation_time"] - m["reference_time"]
        return m

    # ---- checkpoints: the generation batch still being trained on -------------------------------------------
    def _checkpoint_state(self) -> dict:
        state = super()._checkpoint_state()
        if self.generation.num_iterations > 1:  # rows the next steps still train on (zeros when none)
            state["generation_batch"] = self._pending_rows()
        return state

    def _pending_rows(self) -> dict:
        if self._pending is not None and self._pending.remaining > 0:
            return dict(self._pending.rows)
        R, T = self.plan.accumulation * self.plan.micro_batch, self.generation.sequence_len
        like = {k: np.zeros((R, T), np.int32) for k in ("tokens", "positions", "segment_ids", "targets")}
        like.update(completion_mask=np.zeros((R, T), np.float32), advantages=np.zeros((R,), np.float32),
                    old_logps=np.zeros((R, T), np.float32))
        if self.settings.beta > 0:
            like["ref_logps"] = np.zeros((R, T), np.float32)
        return like

    def task_checkpoint_meta(self) -> dict:
        pending = self._pending
        return {"grpo": {"remaining": 0 if pending is None else pending.remaining,
                         "metrics": {} if pending is None else pending.metrics}}

    def restore_task_state(self, state: dict, meta: dict) -> None:
        grpo = meta.get("grpo", {"remaining": 0})
        if grpo["remaining"] > 0:
            rows = {k: np.asarray(v) for k, v in state["generation_batch"].items()}
            self._restored_pending = GenerationBatch(rows, grpo["metrics"], int(grpo["remaining"]))


def _column_names(prompts: list[Prompt]) -> list[str]:
    names: dict[str, None] = {}
    for p in prompts:
        names.update(dict.fromkeys(p.columns))
    return list(names)
