"""DPO, GRPO and distillation runs killed with SIGKILL resume from their last whole checkpoint and then repeat the
uninterrupted run's per-step metrics exactly (fp32, CPU): the loss, the gradient norm, the learning rate and each
trainer's own metrics (DPO rewards, GRPO reward and KL, distillation KL and CE).

Each case trains STEPS steps with a checkpoint every SAVE_STEPS in a subprocess (tests/train/kill_after_step.py)
that is SIGKILLed once the last step's metrics are written, before its checkpoint and export: up to then it is the
uninterrupted run, and its metrics.jsonl rows are the reference. Its saves are waited for, so the resume point is
always SAVE_STEPS (half-written checkpoints are tests/train/test_resume.py's subject). A fresh process running the
same config with resume_from_checkpoint (reading only what the killed one left on disk) trains the steps
after SAVE_STEPS again and must log them exactly as the killed process did, each step once. The resumed run needs
no process of its own (the killed one's memory is gone with it, whatever runs next): it runs in the test process,
one child start-up fewer per case, and loads the killed child's programs from the persistent compilation cache
when the suite sets one (scripts/test.sh) -- the child is pointed at that cache.

GRPO runs num_iterations 2 with sampling at temperature 1: the checkpoint falls inside a generation batch (one
update left on it), and the next generation's completions depend on the sampler's seeds and the prompt order, so
the checkpoint must carry the batch and the resumed run must regenerate the same completions."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from surojax.cli.train_script import main as train_main
from surojax.train.checkpoints import Checkpointer

from tests.train.conftest import FIXTURE_QWEN3, ROOT, distill_config, write_pairs

STEPS, SAVE_STEPS = 5, 3  # GRPO: step 4 is the carried batch's second update, step 5 a new generation
COMMON = dict(max_steps=STEPS, save_steps=SAVE_STEPS, logging_steps=1, lr_scheduler_type="cosine", warmup_steps=2,
              report_to=["jsonl"])
LORA = dict(from_scratch=False, model=str(FIXTURE_QWEN3), model_config=None, lora=True, lora_rank=4, lora_alpha=8)
COMPARED = {"dpo": ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"),
            "grpo": ("reward", "reward_std", "completion_length", "kl", "clip_ratio"),
            "distill": ("kl", "ce")}


def dpo(tiny_config, tmp_path, request) -> dict:
    """LoRA DPO (the reference is the adapter switched off inside the loss), dropout on the adapter."""
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    return tiny_config(**LORA, trainer="dpo", datasets=[{"path": str(pairs), "type": "preference"}], sequence_len=32,
                       per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=2e-2, beta=0.5,
                       lora_dropout=0.1)


def grpo(tiny_config, tmp_path, request) -> dict:
    """LoRA GRPO with a KL term (reference = the adapter off), two updates per generation batch."""
    return request.getfixturevalue("grpo_config")(**LORA, num_iterations=2, temperature=1.0, beta=0.05,
                                                  learning_rate=1e-2)


def distill(tiny_config, tmp_path, request) -> dict:
    """A random tiny student, the fixture qwen3 as the online teacher."""
    return distill_config(tiny_config, sequence_len=32, per_device_train_batch_size=2, gradient_accumulation_steps=2)


def _steps(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """A fresh Python process in tmp_path (GRPO's reward module is there), on the suite's persistent compilation
    cache when there is one (the resumed run in this process then loads its executables instead of compiling them
    again: CPU compiles dominate this test's time), else on one in tmp_path."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path / "xla")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("case", [dpo, grpo, distill], ids=lambda f: f.__name__)
def test_sigkill_then_resume_repeats_the_uninterrupted_run(case, tiny_config, tmp_path, request, capsys):
    cfg = {**case(tiny_config, tmp_path, request), **COMMON, "output_dir": str(tmp_path / "run")}
    run, run_yaml = tmp_path / "run", tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(cfg))
    killed = _run(tmp_path, str(ROOT / "tests" / "train" / "kill_after_step.py"), str(run_yaml), str(STEPS),
                  "--sync-saves")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    reference = {r["step"]: r for r in _steps(run)}
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert Checkpointer(run / "checkpoints").latest_step() == SAVE_STEPS
    assert not (run / "adapter").exists() and not (run / "model").exists()

    run_yaml.write_text(yaml.safe_dump({**cfg, "resume_from_checkpoint": True}))
    capsys.readouterr()
    assert train_main(["--config", str(run_yaml)]) == 0  # GRPO: the working directory is tmp_path (grpo_config)
    assert f"at step {SAVE_STEPS}" in capsys.readouterr().err
    resumed = _steps(run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # each step once: the killed rows rewritten
    name = case.__name__
    for row in resumed[SAVE_STEPS:]:
        want = reference[row["step"]]
        assert row["step_time"] != want["step_time"]  # written by the resumed run, not kept from the killed one
        for key in ("loss", "grad_norm", "lr", *COMPARED[name]):
            assert row[key] == want[key], (name, row["step"], key, row[key], want[key])
    assert (run / "adapter" if cfg.get("lora") else run / "model").is_dir()
