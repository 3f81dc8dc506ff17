"""Train through `python -m surojax.train` and send this very process signals at a chosen point.

    python tests/train/signal_at.py CONFIG SIGNAL step:K [N]   after step K's metrics are written
    python tests/train/signal_at.py CONFIG SIGNAL save:K [N]   inside the checkpoint save of step K, once orbax
                                                               has started writing it (and 0.3 s later)
N (default 1) is how many times the signal is sent. Exits with what the command returns.
"""
import os
import signal
import sys
import time

from surojax.cli.train_script import main
from surojax.train import metrics as metrics_module
from surojax.train.checkpoints import Checkpointer

config, signum, (where, at), times = (sys.argv[1], int(sys.argv[2]), sys.argv[3].split(":"),
                                      int(sys.argv[4]) if len(sys.argv) > 4 else 1)
at = int(at)


def send() -> None:
    for _ in range(times):
        os.kill(os.getpid(), signum)
        time.sleep(0.05)


_write, _save = metrics_module.Metrics.write, Checkpointer.save


def write_then_signal(self, step, metrics):
    _write(self, step, metrics)
    if where == "step" and step == at and "loss" in metrics:
        send()


def save_with_signal(self, step, state, meta):
    _save(self, step, state, meta)
    if where == "save" and step == at:
        send()
        time.sleep(0.3)


# A background job's children start with SIGINT ignored (which Interrupts respects): this process wants it.
signal.signal(signal.SIGINT, signal.default_int_handler)
metrics_module.Metrics.write = write_then_signal
Checkpointer.save = save_with_signal
sys.exit(main(["--config", config]))
