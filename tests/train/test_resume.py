"""A training process killed with SIGKILL resumes from its last whole checkpoint and then repeats the
uninterrupted run's per-step losses exactly (fp32, CPU, same data order and dropout keys): the killed process's own
rows up to its kill are the uninterrupted run's. The resumed run reads only what the killed one left on disk (its
memory is gone with it), so it runs in this process through the same main as `python -m surojax.train` (one child
start-up fewer), as tests/train/test_post_training_resume.py's resumes do."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from surojax.cli.train_script import main as train_main
from surojax.train.checkpoints import Checkpointer

from tests.train.conftest import ROOT

HERE = Path(__file__).parent


def _killed_run(config: Path, after_step: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(HERE / "kill_after_step.py"), str(config), str(after_step)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_sigkill_then_resume_repeats_the_uninterrupted_losses(tmp_path, tiny_config, capsys):
    """The killed process is the uninterrupted run up to its kill (it logs steps 1..5 before dying): the resumed
    process must log the steps after its checkpoint up to 5 with exactly those losses, then finish and export."""
    cfg = tiny_config(output_dir=str(tmp_path / "run"), max_steps=8, save_steps=2, lora_dropout=0.0,
                      lr_scheduler_type="cosine", warmup_steps=2)
    run_cfg = tmp_path / "run.yaml"
    run_cfg.write_text(yaml.safe_dump(cfg))
    killed = _killed_run(run_cfg, 5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "run" / "model").exists()
    reference = {x["step"]: x for x in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
                 if "loss" in x}
    assert sorted(reference) == list(range(1, 6))
    resume_step = Checkpointer(tmp_path / "run" / "checkpoints").latest_step()
    assert resume_step in (2, 4)  # step 4's async write may or may not have finished before the kill

    run_cfg.write_text(yaml.safe_dump(dict(cfg, resume_from_checkpoint=True)))
    capsys.readouterr()
    assert train_main(["--config", str(run_cfg)]) == 0
    assert f"at step {resume_step}" in capsys.readouterr().err
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x for x in rows if "loss" in x]
    # the killed process logged steps up to 5; the resumed one logs them again from its checkpoint on:
    # metrics.jsonl holds each step once, and the re-logged ones (rewritten rows) equal the killed run's
    assert [x["step"] for x in losses] == list(range(1, 9))
    for x in losses[resume_step:5]:
        want = reference[x["step"]]
        assert x["step_time"] != want["step_time"]  # written by the resumed run, not kept from the killed one
        assert x["loss"] == want["loss"], (x["step"], x["loss"], want["loss"])
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def test_a_half_written_checkpoint_is_never_listed(tmp_path):
    import numpy as np

    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(2, {"w": np.ones(3, np.float32)}, {"step": 2})
    ck.close()
    # what an interrupted orbax save leaves behind: the step's temporary folder, never renamed
    (tmp_path / "ck" / "4.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "ck" / "4.orbax-checkpoint-tmp-1234" / "partial").write_text("x")
    assert Checkpointer(tmp_path / "ck").latest_step() == 2


def test_a_checkpoint_whose_arrays_do_not_fit_is_a_named_error(tmp_path):
    """Before orbax reads an array: a checkpoint without a recorded config (an older one) whose arrays differ from
    the run's is an error naming them, with shapes, instead of a TensorStore traceback."""
    import numpy as np
    import pytest

    from surojax.config import config_from_dict
    from surojax.train.checkpoint_match import CheckpointMismatchError, check

    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(2, {"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)}, {"step": 2})
    cfg = config_from_dict({"model": "m", "datasets": [{"path": "d.jsonl"}]})
    assert check(ck, 2, cfg, {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}) == []
    with pytest.raises(CheckpointMismatchError) as e:
        check(ck, 2, cfg, {"w": np.zeros((3, 4), np.float32), "c": np.zeros(2, np.float32)})
    ck.close()
    assert str(e.value).splitlines() == [
        f"checkpoint {tmp_path / 'ck' / '2'} does not fit this run: 3 of its arrays differ",
        "  w: [3, 2] in the checkpoint, [3, 4] in this run", "  c: not in the checkpoint",
        "  b: in the checkpoint, not in this run", "its run's config is not recorded in it (an older checkpoint)"]


def test_a_run_after_an_unfinished_first_save_says_so_and_never_appends_to_the_old_metrics(tmp_path, tiny_config):
    """What a second Ctrl-C during the first save leaves (an unfinished `4.orbax-checkpoint-tmp-*`, metrics.jsonl
    with steps 1-4, no whole checkpoint): the next run names the unfinished save and removes it, and moves the old
    metrics.jsonl aside (saying where) instead of appending its own steps 1, 2, ... after the old ones."""
    import io

    from rich.console import Console

    from surojax.config import config_from_dict
    from surojax.train.trainers import make_trainer

    out = tmp_path / "run"
    unfinished = out / "checkpoints" / "4.orbax-checkpoint-tmp-1765432100"
    unfinished.mkdir(parents=True)
    (unfinished / "partial").write_text("x")
    old = "".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(1, 5))
    (out / "metrics.jsonl").write_text(old)
    console = Console(file=io.StringIO(), width=300)
    trainer = make_trainer(config_from_dict(tiny_config(output_dir=str(out), save_steps=4)), console=console)
    trainer.metrics.write(1, {"loss": 9.0})
    trainer.close()
    said = console.file.getvalue()
    assert f"{unfinished}: an unfinished checkpoint" in said and not unfinished.exists()
    assert f"{out / 'metrics.jsonl'} held steps 1-4 of an earlier run with no checkpoint to resume; moved to " \
           f"{out / 'metrics.1.jsonl'}" in said
    assert (out / "metrics.1.jsonl").read_text() == old
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
