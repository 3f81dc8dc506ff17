"""Interrupts that lose no work: SIGINT (Ctrl-C) and SIGTERM (what SLURM and Kubernetes send before preemption)
ask the training loop to stop at the next step boundary instead of raising KeyboardInterrupt mid-step.

    with Interrupts() as interrupts:         # installs the handlers (main thread only), restores them on exit
        while ...:
            step()
            if interrupts.requested:         # finish the step, save a checkpoint, close, exit interrupts.exit_code
                ...

The first signal only sets the flag (and prints one line). A second one restores the default handlers and
ends the process at once with os._exit(128 + signum): no Python clean-up runs, so nothing half-written can
be taken for a whole artifact only because every writer is atomic — orbax writes a checkpoint to a temporary
folder that is renamed when complete (an unrenamed one is never listed, see checkpoints.py), and model /
adapter exports are written under a temporary name and renamed (weights/hf_checkpoint.py, peft/peft_io.py).

Why not KeyboardInterrupt: raised between two bytecodes, it unwinds past `checkpointer.close()` while orbax's
async save thread and grain's prefetch threads still run; the interpreter then exits under them, which ended
in `RuntimeError: can't create new thread at interpreter shutdown` or `terminate called without an active
exception` (SIGABRT) and no checkpoint at the point of interruption.

A signal that is ignored when the context is entered (SIG_IGN, e.g. SIGINT in a background job of a
non-interactive shell) stays ignored. Outside the main thread (where Python cannot install handlers) the
context does nothing and `requested` stays False.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code_for(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + signum (SIGINT 130, SIGTERM 143)."""
    return 128 + signum


class Interrupts:
    """Context manager turning SIGINT / SIGTERM into a flag the training loop polls (module docstring)."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signals = signals
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int | None:
        """130 after SIGINT, 143 after SIGTERM, None while no signal came."""
        return None if self.signum is None else exit_code_for(self.signum)

    @property
    def name(self) -> str:
        return "" if self.signum is None else signal.Signals(self.signum).name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second signal: leave now, nothing atomic can be half-taken
            for s in self.signals:
                signal.signal(s, signal.SIG_DFL)
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now without saving\n".encode())
            os._exit(exit_code_for(signum))
        self.signum = signum
        os.write(2, f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
                    f"(press Ctrl-C again to exit at once)\n".encode())

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                previous = signal.getsignal(s)
                if previous == signal.SIG_IGN:
                    continue
                self._previous[s] = previous
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        sys.stderr.flush()
