"""`surojax bench CONFIG`: time a training YAML's own steps — its model, data, trainer kind and settings — through
the Trainer (`make_trainer`), without writing anything where the run would.

    result = run_config(cfg, steps=20, warmup=3)      # one JSON-able record

What runs: the Trainer the config describes (sft / pt / dpo / grpo / distill), its output_dir replaced by a temporary
folder (deleted afterwards) and its checkpoints off, so the user's outputs are never touched. Timing
(shared/BENCHMARKS.md): the first step compiles (reported as `first_step_s`), `warmup` more untimed steps, then
`steps` timed steps; the step time is their median (each step's `step_time` as the Trainer measures it, which
blocks on the step's metrics), tokens/s its median (the trainer's own count: rows x sequence_len; DPO both
sequences of a pair). Peak memory: the first device's peak_bytes_in_use (None on CPU).
"""
from __future__ import annotations

import statistics
import tempfile
import time

import jax

from surojax.config.load import config_from_dict
from surojax.config.schema import TrainConfig
from surojax.kernel_settings import kernel_settings
from surojax.train.trainers import make_trainer

NEVER = 10**9  # a save_steps no timed run reaches


def bench_config(cfg: TrainConfig, output_dir: str, steps: int, warmup: int) -> TrainConfig:
    """`cfg` with its outputs moved to `output_dir`, no checkpoint, no validation pass, and room for the steps."""
    data = cfg.model_dump(exclude_unset=True)
    data.update(output_dir=output_dir, save_steps=NEVER, max_steps=max(cfg.max_steps or 0, 1 + warmup + steps),
                report_to=["jsonl"], resume_from_checkpoint=False)
    if cfg.eval_steps is not None:
        data["eval_steps"] = NEVER
    return config_from_dict(data)


def run_config(cfg: TrainConfig, *, steps: int, warmup: int) -> dict:
    """Build the config's trainer in a temporary output folder, run 1 + warmup + steps steps -> the record."""
    with tempfile.TemporaryDirectory(prefix="surojax-bench-") as tmp:
        run = bench_config(cfg, tmp, steps, warmup)
        t0 = time.perf_counter()
        trainer = make_trainer(run)
        build_s = time.perf_counter() - t0
        try:
            first = trainer.step()
            for _ in range(warmup):
                trainer.step()
            timed = [trainer.step() for _ in range(steps)]
        finally:
            trainer.close()
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "trainer": trainer.loop.trainer, "steps": steps, "warmup": warmup,
        "step_ms": 1e3 * statistics.median(m["step_time"] for m in timed),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
        "first_step_s": first["step_time"], "build_s": build_s,
        "loss_first": first["loss"], "loss_last": timed[-1]["loss"] if timed else first["loss"],
        "peak_gib": stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None,
        "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "jax": jax.__version__,
        "kernel_overrides": kernel_settings().overrides(),  # SUROJAX_* A/B overrides (surojax/kernel_settings.py)
    }
