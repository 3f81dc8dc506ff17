"""Run training from a YAML, SIGKILLing this very process once optimizer step K's metrics are written.

    python tests/train/kill_after_step.py CONFIG K [--sync-saves]
The config's `trainer` picks the class (surojax.train.trainers: sft, dpo, grpo, distill).
Nothing is flushed or finished: in-flight async checkpoint writes die with the process. With --sync-saves each
checkpoint save is waited for, so the kill leaves exactly the checkpoints of the steps <= K (a resume point that
does not depend on how fast orbax wrote).
"""
import os
import signal
import sys

from surojax.config import load_config
from surojax.train import metrics as metrics_module
from surojax.train.checkpoints import Checkpointer
from surojax.train.trainers import make_trainer

config, kill_after = sys.argv[1], int(sys.argv[2])
sync_saves = "--sync-saves" in sys.argv[3:]
_write, _save = metrics_module.Metrics.write, Checkpointer.save


def write_then_maybe_die(self, step, metrics):
    _write(self, step, metrics)
    if step >= kill_after and "loss" in metrics:
        os.kill(os.getpid(), signal.SIGKILL)


def save_and_wait(self, step, state, meta):
    _save(self, step, state, meta)
    self.wait()


metrics_module.Metrics.write = write_then_maybe_die
if sync_saves:
    Checkpointer.save = save_and_wait
make_trainer(load_config(config)).train()
