"""SIGINT / SIGTERM stop a training process after the current step with a whole checkpoint there, exit 130 / 143
without a traceback or an abort, and a resume repeats the uninterrupted twin's per-step losses exactly (fp32, CPU).
The interrupted runs are subprocesses: the process boundary (handlers, threads alive at exit, the exit status) is what
is tested. The resumes are not: they read only what the interrupted process left on disk (its memory is gone with
it), so they run in this process through the same main as `python -m surojax.train` (one child start-up fewer each)
and load the programs the twin compiled."""
import json
import os
import random
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from surojax.cli.train_script import main as train_main
from surojax.train.checkpoints import Checkpointer

from tests.tiny import QWEN3, hf
from tests.train.conftest import ROOT, TOKENIZER, write_text_data

HERE = Path(__file__).parent
STEPS = 8


def _config(directory: Path, data: Path) -> Path:
    cfg = {"from_scratch": True, "tokenizer": str(TOKENIZER), "model_config": hf(QWEN3),
           "output_dir": str(directory / "out"), "recipe": "fp32", "recompute": "none",
           "datasets": [{"path": str(data), "type": "text"}], "sequence_len": 64, "per_device_train_batch_size": 2,
           "gradient_accumulation_steps": 2, "learning_rate": 3e-3, "lr_scheduler_type": "cosine",
           "warmup_steps": 2, "max_steps": STEPS, "save_steps": 4, "logging_steps": 1, "seed": 0}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run.yaml").write_text(yaml.safe_dump(cfg))
    return directory / "run.yaml"


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "COLUMNS": "200"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_clean(r: subprocess.CompletedProcess) -> None:
    for bad in ("Traceback", "terminate called", "Aborted", "can't create new thread"):
        assert bad not in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """The uninterrupted run: {step: loss} for steps 1..STEPS, and the data file every run shares. It needs no
    process of its own (nothing interrupts it): run in this one, one start-up fewer; its compiled programs reach the
    children through the persistent compilation cache when the suite sets one (scripts/test.sh)."""
    root = tmp_path_factory.mktemp("twin")
    data = write_text_data(root / "text.jsonl")
    assert train_main(["--config", str(_config(root / "ref", data))]) == 0
    losses = {row["step"]: row["loss"] for row in _rows(root / "ref" / "out") if "loss" in row}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, data


def _resume(config: Path, capsys) -> int:
    """`python -m surojax.train --config CONFIG -o resume_from_checkpoint=true`, run in this process (its stderr then
    in capsys)."""
    capsys.readouterr()
    return train_main(["--config", str(config), "-o", "resume_from_checkpoint=true"])


def _interrupt_then_resume(tmp_path, twin, capsys, signum: int,
                           where: str) -> tuple[subprocess.CompletedProcess, int]:
    reference, data = twin
    config = _config(tmp_path, data)
    r = _run(str(HERE / "signal_at.py"), str(config), str(int(signum)), where)
    assert r.returncode == 128 + signum, r.stderr[-3000:]
    _assert_clean(r)
    out = tmp_path / "out"
    assert not (out / "model").exists()  # nothing exported by an interrupted run
    step = Checkpointer(out / "checkpoints").latest_step()
    resume = shlex.join([sys.executable, "-m", "surojax.train", "--config", str(config), "-o",
                         "resume_from_checkpoint=true"])
    assert resume in r.stderr, r.stderr[-2000:]

    assert _resume(config, capsys) == 0
    assert f"at step {step}" in capsys.readouterr().err
    rows = [row for row in _rows(out) if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # every step once, none repeated
    assert {row["step"]: row["loss"] for row in rows} == reference
    return r, step


def test_sigint_at_a_random_step_checkpoints_there_and_resumes_to_the_twin(tmp_path, twin, capsys):
    at = random.Random(14).randint(1, STEPS - 2)  # not on a save_steps multiple or the end: a dedicated save
    assert at % 4
    _, step = _interrupt_then_resume(tmp_path, twin, capsys, signal.SIGINT, f"step:{at}")
    assert step == at


def test_sigterm_during_a_checkpoint_save_keeps_that_checkpoint_and_resumes(tmp_path, twin, capsys):
    r, step = _interrupt_then_resume(tmp_path, twin, capsys, signal.SIGTERM, "save:4")
    assert step == 4 and "SIGTERM: stopped at step 4/8" in r.stderr


def test_a_second_sigint_exits_at_once_and_leaves_only_whole_checkpoints(tmp_path, twin, capsys):
    _, data = twin
    config = _config(tmp_path, data)
    r = _run(str(HERE / "signal_at.py"), str(config), str(int(signal.SIGINT)), "save:4", "2")
    assert r.returncode == 130, r.stderr[-3000:]
    assert "SIGINT again: exiting now" in r.stderr and "Traceback" not in r.stderr
    # step 4's async write died with the process: whatever is left must not be taken for a checkpoint, so the
    # resume starts from a whole one (or from step 0) and still repeats the twin's losses
    assert _resume(config, capsys) == 0
    rows = [row for row in _rows(tmp_path / "out") if "loss" in row]
    assert {row["step"]: row["loss"] for row in rows} == twin[0] and len(rows) == STEPS
