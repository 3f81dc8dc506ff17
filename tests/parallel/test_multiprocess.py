"""Multi-process runs on CPU: `surojax launch` starts 2 JAX processes of 4 virtual devices each (gloo collectives);
their training (full fine-tuning of the fixture HF qwen3, each process loading the shards of its devices) must log
the losses of ONE process on one device over the same global batches, resume exactly after one of them is SIGKILLed,
and exchange checkpoints with one-process runs in both directions.

The global batch is the per-device batch x the batch-splitting mesh axes (data x fsdp): the one-device reference
takes all of it on its one device. Losses agree to rel 1e-4, not exactly: the 2-process micro-batch holds the same
rows in another order and its sums are reduced across 8 devices (fp32 summation order).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml

from surojax.cli.train_script import main as train_main
from surojax.parallel.distributed import DistributedSetupError, ProcessEnv, process_env
from tests.train.conftest import FIXTURE_QWEN3, ROOT, tiny_config  # noqa: F401  (the fixture)
from tests.parallel.virtual_devices import FAST_COMPILE  # every run of a test compiled alike (see there)

PARALLEL = {"data": 2, "stage": 2, "fsdp": 2}  # 2 processes x 4 devices: issue 17's mesh (pipeline stages across processes)
DEVICES_PER_PROCESS = 4
PER_DEVICE_BATCH = 1
GLOBAL_BATCH = PER_DEVICE_BATCH * PARALLEL.get("data", 1) * PARALLEL.get("fsdp", 1) * PARALLEL.get("expert", 1)
REL = 1e-4
TIMEOUT_S = 300

# Train like `python -m surojax.train`, but the process whose SUROJAX_PROCESS_ID is 1 SIGKILLs itself once step K's
# metrics are written; checkpoint saves are waited for, so exactly the checkpoints of the steps <= K exist.
KILL_RANK_1 = """
import os, signal, sys
from surojax.config import load_config
from surojax.parallel.distributed import initialize_from_env
from surojax.train import metrics
from surojax.train.checkpoints import Checkpointer
from surojax.train.trainers import make_trainer

initialize_from_env()
kill_after = int(sys.argv[2])
write, save = metrics.Metrics.write, Checkpointer.save

def write_then_die(self, step, m):
    write(self, step, m)
    if os.environ["SUROJAX_PROCESS_ID"] == "1" and step >= kill_after and "loss" in m:
        os.kill(os.getpid(), signal.SIGKILL)

def save_and_wait(self, step, state, meta):
    save(self, step, state, meta)
    self.wait()

metrics.Metrics.write, Checkpointer.save = write_then_die, save_and_wait
make_trainer(load_config(sys.argv[1])).train()
"""

# `python -m surojax.train --config C` for each config C in turn, in each launched process: one start-up and one
# jax.distributed set-up for two runs; a line between them splits their output
TRAIN_EACH = """
import sys
from surojax.cli.train_script import main

for i, config in enumerate(sys.argv[1:]):
    if i:
        print("NEXT RUN", file=sys.stderr, flush=True)
    rc = main(["--config", config])
    if rc:
        sys.exit(rc)
"""


def _env(devices: int, cache: Path | None = None) -> dict[str, str]:
    """A child's environment: CPU with `devices` virtual devices; `cache`: JAX's compilation cache there (the runs
    of one test compile the same programs: each compiles once)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"}
    if cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def _launch(*cmd: str, cache: Path | None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "surojax.cli.main", "launch", "--nproc-per-node", "2", "--", *cmd]
    return subprocess.run(argv, cwd=ROOT, env=_env(DEVICES_PER_PROCESS, cache), capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _train_one_process(config: Path) -> int:
    """`python -m surojax.train --config CONFIG` on one device, in this process: the one-process runs are the
    reference and the checkpoint exchange's other side, no process boundary is tested there (under scripts/test.sh
    this process compiles as the children do, FAST_COMPILE, and the second run loads the first's programs from the
    suite's persistent compilation cache)."""
    assert jax.device_count() == 1  # the one-device reference (the suite's process: no virtual devices)
    return train_main(["--config", str(config)])


def _losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _eval_loss(out_dir: Path) -> float:
    """The final validation loss (written once, after the last step)."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return last


def _assert_losses(out_dir: Path, reference: Path, steps: range) -> None:
    """Per-step train losses of `steps`, and the final validation loss, those of the `reference` run."""
    got, want = _losses(out_dir), _losses(reference)
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert math.isclose(got[s], want[s], rel_tol=REL), (s, got[s], want[s])
    assert math.isclose(_eval_loss(out_dir), _eval_loss(reference), rel_tol=REL)


def _write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_two_processes_train_resume_and_exchange_checkpoints_with_one(tmp_path, tiny_config):
    cache = tmp_path / "xla_cache"

    def config(**overrides) -> dict:  # full fine-tuning of the fixture HF qwen3: each process loads its shards
        cfg = tiny_config(**overrides)
        del cfg["model_config"]
        return dict(cfg, from_scratch=False, model=str(FIXTURE_QWEN3))

    common = dict(max_steps=4, save_steps=2, gradient_accumulation_steps=2, lr_scheduler_type="cosine",
                  warmup_steps=2, validation_split_ratio=0.1)
    # the reference: one process, one device, the whole global batch on it; its checkpoints are one-process ones
    ref = _write(tmp_path / "ref.yaml", config(output_dir=str(tmp_path / "ref"),
                                                    per_device_train_batch_size=GLOBAL_BATCH, **common))
    assert _train_one_process(ref) == 0
    reference = tmp_path / "ref"
    assert sorted(_losses(reference)) == list(range(1, 5))

    # 2 processes x 4 devices; rank 1 dies (SIGKILL) after step 3: the launcher stops rank 0 and says so
    mp = config(output_dir=str(tmp_path / "mp"), per_device_train_batch_size=PER_DEVICE_BATCH,
                     parallel=PARALLEL, **common)
    mp_cfg = _write(tmp_path / "mp.yaml", mp)
    killed = _launch("python", "-c", KILL_RANK_1, str(mp_cfg), "3", cache=cache)
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr[-3000:]
    assert "rank 1 exited with code 137" in killed.stderr
    assert not (tmp_path / "mp" / "model").exists()
    assert sorted(p.name for p in (tmp_path / "mp" / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]

    # a checkpoint written by 2 processes (the killed run's step 2) continues in 1 (one device, the same global
    # batch) ...
    shutil.copytree(tmp_path / "mp" / "checkpoints" / "2", tmp_path / "from_mp" / "2")
    to_one = _write(tmp_path / "to_one.yaml", config(
        output_dir=str(tmp_path / "to_one"), per_device_train_batch_size=GLOBAL_BATCH,
        resume_from_checkpoint=str(tmp_path / "from_mp" / "2"), **common))
    assert _train_one_process(to_one) == 0
    _assert_losses(tmp_path / "to_one", reference, range(3, 5))

    # resumed in 2 processes: the remaining steps repeat the one-process losses; process 0 alone writes the export.
    # ... and one written by 1 process continues in 2: the next run of the same launch (TRAIN_EACH)
    _write(mp_cfg, dict(mp, resume_from_checkpoint=True))
    shutil.copytree(tmp_path / "ref" / "checkpoints" / "2", tmp_path / "from_ref" / "2")
    to_two = _write(tmp_path / "to_two.yaml", dict(mp, output_dir=str(tmp_path / "to_two"),
                                                   resume_from_checkpoint=str(tmp_path / "from_ref" / "2")))
    r = _launch("python", "-c", TRAIN_EACH, str(mp_cfg), str(to_two), cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[0] NEXT RUN" in r.stderr and "[1] NEXT RUN" in r.stderr, r.stderr[-3000:]
    resume_err = r.stderr.split("[0] NEXT RUN", 1)[0]  # rank 0's lines of the first run
    assert "[0] resumed" in resume_err and "[1] resumed" not in r.stderr
    _assert_losses(tmp_path / "mp", reference, range(1, 5))
    assert (tmp_path / "mp" / "model" / "model.safetensors").is_file()
    _assert_losses(tmp_path / "to_two", reference, range(3, 5))


def test_launch_stops_every_rank_when_one_fails_and_reports_it(tmp_path):
    survivor = tmp_path / "survivor"
    program = ("import os, sys, time, pathlib\n"
               "rank = int(os.environ['SUROJAX_PROCESS_ID'])\n"
               "if rank == 1:\n"
               "    print('rank 1 cannot read its shard', file=sys.stderr); sys.exit(7)\n"
               f"time.sleep(60); pathlib.Path({str(survivor)!r}).write_text('still running')\n")
    r = subprocess.run([sys.executable, "-m", "surojax.cli.main", "launch", "--nproc-per-node", "3", "--", "python",
                        "-c", program], cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=60)
    assert r.returncode == 7, r.stderr
    assert "[1] rank 1 cannot read its shard" in r.stderr
    assert "rank 1 exited with code 7" in r.stderr
    assert not survivor.exists()


def test_process_env_reads_launch_then_slurm_else_one_process():
    launch = {"SUROJAX_COORDINATOR_ADDRESS": "node0:1234", "SUROJAX_NUM_PROCESSES": "4", "SUROJAX_PROCESS_ID": "3"}
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[0-1]", "SLURM_NTASKS": "16", "SLURM_PROCID": "9",
             "SLURM_LOCALID": "1"}
    assert process_env(launch) == ProcessEnv(3, 4, "launch", "node0:1234")
    assert process_env({**slurm, **launch}).source == "launch"  # surojax launch inside an allocation wins
    assert process_env(slurm) == ProcessEnv(9, 16, "slurm")
    assert not process_env(slurm).is_main
    assert process_env({**slurm, "SLURM_NTASKS": "1"}) == ProcessEnv(0, 1, "single")
    assert process_env({}).is_main
    with pytest.raises(DistributedSetupError, match="SUROJAX_PROCESS_ID"):
        process_env({k: v for k, v in launch.items() if k != "SUROJAX_PROCESS_ID"})
    with pytest.raises(DistributedSetupError, match=r"not in \[0"):
        process_env({**launch, "SUROJAX_PROCESS_ID": "4"})
