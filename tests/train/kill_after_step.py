"""Run training from a YAML, SIGKILLing this very process once optimizer step K's metrics are written.

    python tests/train/kill_after_step.py CONFIG K
Nothing is flushed or finished: in-flight async checkpoint writes die with the process.
"""
import os
import signal
import sys

from surojax.config import load_config
from surojax.train import metrics as metrics_module
from surojax.train.trainer import Trainer

config, kill_after = sys.argv[1], int(sys.argv[2])
_write = metrics_module.Metrics.write


def write_then_maybe_die(self, step, metrics):
    _write(self, step, metrics)
    if step >= kill_after and "loss" in metrics:
        os.kill(os.getpid(), signal.SIGKILL)


metrics_module.Metrics.write = write_then_maybe_die
Trainer(load_config(config)).train()
