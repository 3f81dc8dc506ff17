"""GRPO rollouts: the serving Engine over the trainer's live weights, and the completions as training rows.

    rollout = Rollout(model, tokenizer, RolloutSettings(...), rows=R, sequence_len=T)
    rollout.set_weights(model)                            # each generation batch: the trainer's current weights
    completions = rollout.generate(prompt_ids, seeds)     # [R] (token ids, truncated?) in request order
    rows = completion_rows(prompt_ids, completions, T)    # dict of [R, T] arrays (the grpo_loss batch contract)

The engine (surojax/serve/engine.py: paged KV, continuous batching, prefix caching) is built once on the model
the trainer hands over: `nnx.merge(eval_graphdef, trainable, frozen)`, a module whose Variables hold the trainer's
own arrays (no copy). `set_weights` points the engine's runner at the new arrays (`PagedRunner.refresh_weights`:
the same graph, so nothing recompiles) and drops the prefix cache, whose blocks hold KV of the old weights. LoRA
runs as it trains: the base and the adapter as separate variables, the delta applied in every matmul.

KV pool: `kv_blocks(rows, sequence_len, block_size)` = rows x ceil(T / block_size) blocks, every completion of
the batch at its longest at once (no preemption); the G completions of a prompt share its full prompt blocks
(prefix caching), which only leaves blocks free. Its bytes (`kv_bytes`) are added to the training memory plan by
the trainer, which refuses a run whose sum exceeds the device. A hybrid model (Qwen3.5) is served with a state slot
per row (serve/state_slots.py, counted with the pool) and without prefix caching (the engine turns it off).

Determinism: every request carries its own seed; the engine's sampler keys a row by fold_in(key(seed), position),
so a completion depends on its prompt, its seed and the weights only, never on the batch around it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from surojax.generation.sampling import SamplingParams
from surojax.models.config import ModelConfig
from surojax.serve.capacity import kv_bytes_per_token
from surojax.serve.config import EngineConfig, SchedulerConfig
from surojax.serve.engine import Engine

BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How completions are sampled: at most `max_completion_length` new tokens, ending at an id of
    `stop_token_ids` (kept in the completion); temperature / top_p as the engine's sampler applies them."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Completion:
    ids: tuple[int, ...]
    truncated: bool  # ended at max_completion_length without a stop token


def kv_blocks(rows: int, sequence_len: int, block_size: int = BLOCK_SIZE) -> int:
    """KV blocks for `rows` sequences of up to `sequence_len` tokens all resident at once."""
    return rows * math.ceil(sequence_len / block_size)


def kv_bytes(cfg: ModelConfig, num_blocks: int, kv_dtype, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of the engine's pools: k and v, [L, num_blocks * block_size, K, H] each per KV shape
    (`serve.capacity.kv_bytes_per_token`)."""
    return kv_bytes_per_token(cfg, kv_dtype) * num_blocks * block_size


class Rollout:
    """The serving engine co-located with the trainer, sized for `rows` completions of `sequence_len` tokens."""

    def __init__(self, model, tokenizer, settings: RolloutSettings, *, rows: int, sequence_len: int):
        self.settings = settings
        self.num_blocks = kv_blocks(rows, sequence_len)
        sched = SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=max(8192, sequence_len),
                                max_model_len=sequence_len)
        self.engine = Engine(model, EngineConfig(scheduler=sched, block_size=BLOCK_SIZE, num_blocks=self.num_blocks,
                                                 enable_prefix_caching=True), tokenizer=None)

    def set_weights(self, model) -> None:
        """Generate from `model`'s current arrays (the same graph as the engine's model) from now on."""
        if self.engine.has_unfinished():
            raise RuntimeError("set_weights while requests run: their KV would mix two sets of weights")
        self.engine.model = model
        self.engine.runner.refresh_weights(model)
        self.engine.kv.reset_prefix_cache()

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> list[Completion]:
        """One completion per (prompt, seed), in order. Requests of equal prompts added one after the other share
        the prompt's full KV blocks (prefix caching: the prompt of a group is prefilled once)."""
        s = self.settings
        rids = []
        for i, (ids, seed) in enumerate(zip(prompts, seeds, strict=True)):
            params = SamplingParams(max_tokens=s.max_completion_length, temperature=s.temperature, top_p=s.top_p,
                                    seed=int(seed) & 0xFFFFFFFF, stop_token_ids=s.stop_token_ids)
            rids.append(self.engine.add_request(list(ids), params, request_id=f"rollout-{i}"))
        out: dict[str, list[int]] = {r: [] for r in rids}
        reason: dict[str, str | None] = {}
        while self.engine.has_unfinished():
            for o in self.engine.step():
                out[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    reason[o.request_id] = o.finish_reason
        return [Completion(tuple(out[r]), reason.get(r) == "length") for r in rids]


def completion_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Completion], sequence_len: int,
                    *, mask_truncated: bool = False) -> dict[str, np.ndarray]:
    """Prompt + completion, one sequence per row, as the GRPO loss reads them (all [R, T], T = sequence_len):
    tokens / positions / segment_ids (1 real, 0 padding) / targets (the next token) as in surojax/data/batch.py,
    and completion_mask (float32) 1.0 where `targets` is a completion token. `mask_truncated`: rows whose
    completion hit the length limit get an all-zero mask (DAPO's overlong filtering)."""
    R, T = len(prompts), sequence_len
    rows = {k: np.zeros((R, T), np.int32) for k in ("tokens", "positions", "segment_ids", "targets")}
    mask = np.zeros((R, T), np.float32)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids = list(p) + list(c.ids)
        n = len(ids)
        if n > T:
            raise ValueError(f"row {r}: prompt {len(p)} + completion {len(c.ids)} tokens exceed sequence_len {T}")
        rows["tokens"][r, :n] = ids
        rows["positions"][r, :n] = np.arange(n)
        rows["segment_ids"][r, :n] = 1
        rows["targets"][r, :n - 1] = ids[1:]
        if not (mask_truncated and c.truncated):
            mask[r, len(p) - 1:n - 1] = 1.0  # position t predicts ids[t + 1]: the completion's tokens
    rows["completion_mask"] = mask
    return rows
