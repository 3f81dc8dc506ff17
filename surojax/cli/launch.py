"""`surojax launch --nproc-per-node N [--nnodes M --node-rank R --coordinator HOST:PORT] -- COMMAND ...`

Starts this node's N processes of an M-node run (one per GPU; or N CPU processes for tests) and watches them:

    surojax launch --nproc-per-node 8 -- sft run.yaml                 # one node, 8 GPUs
    surojax launch --nproc-per-node 8 --nnodes 2 --node-rank 0 --coordinator node0:12355 -- sft run.yaml

COMMAND is a surojax command (`sft run.yaml`, run as `python -m surojax.cli.main sft run.yaml`) or any program
(`python -m surojax.train --config run.yaml`, `python -c ...`; `python` is the launcher's interpreter). Each process gets the launcher's environment plus
(surojax/parallel/distributed.py reads them):

    SUROJAX_COORDINATOR_ADDRESS  host:port of process 0's coordinator (--coordinator, or a free local port
                                 for a single node)
    SUROJAX_NUM_PROCESSES        nnodes x nproc-per-node
    SUROJAX_PROCESS_ID           node_rank x nproc-per-node + local rank
    SUROJAX_LOCAL_RANK           the process's index on this node
    CUDA_VISIBLE_DEVICES         with N > 1: the local rank-th GPU (of the launcher's CUDA_VISIBLE_DEVICES list when
                                 set), so each process drives one GPU

Every output line of process r is printed as `[r] line` (stdout to stdout, stderr to stderr). When a process
exits with an error, the others are stopped (SIGTERM, then SIGKILL after --grace seconds), the failed rank and its
last lines are printed, and the launcher exits with its code (128 + signal for a process killed by a signal).
SIGINT / SIGTERM to the launcher are passed on to every process (a training run then checkpoints and stops), and
the launcher waits for all of them (a second signal, passed on too, ends a training run at once).
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from surojax.cli.common import UsageError, positive_int, print_error
from surojax.cli.main import COMMANDS

LAST_LINES = 20
POLL_S = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=positive_int, required=True, metavar="N",
                        help="processes on this node (one per GPU; N CPU processes on a machine without GPUs)")
    parser.add_argument("--nnodes", type=positive_int, default=1, metavar="M", help="nodes in the run (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's index, 0 .. M-1")
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="process 0's coordinator address (needed with --nnodes > 1; default: a free local port)")
    parser.add_argument("--grace", type=float, default=5.0, metavar="S",
                        help="seconds the other processes get after SIGTERM when one failed, before SIGKILL")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="a surojax command (sft run.yaml) or any program (python -m surojax.train ...)")


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(words: Sequence[str]) -> list[str]:
    """The program to start: a surojax command runs under this Python; anything else as given."""
    words = list(words[1:] if words and words[0] == "--" else words)
    if not words:
        raise UsageError("launch: no command after `--` (e.g. `surojax launch --nproc-per-node 2 -- sft run.yaml`)")
    if words[0] == "surojax":
        words = words[1:]
    if words and words[0] in COMMANDS:
        return [sys.executable, "-m", "surojax.cli.main", *words]
    if words[0] in ("python", "python3"):  # the launcher's interpreter (its virtual environment), as torchrun does
        return [sys.executable, *words[1:]]
    return words


def process_environ(base: Mapping[str, str], *, coordinator: str, num_processes: int, process_id: int,
                    local_rank: int, nproc_per_node: int) -> dict[str, str]:
    """The environment of one launched process: `base` plus the distributed variables (module docstring)."""
    env = {**base, "SUROJAX_COORDINATOR_ADDRESS": coordinator, "SUROJAX_NUM_PROCESSES": str(num_processes),
           "SUROJAX_PROCESS_ID": str(process_id), "SUROJAX_LOCAL_RANK": str(local_rank), "PYTHONUNBUFFERED": "1"}
    if nproc_per_node > 1:
        visible = [g for g in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        if visible and len(visible) < nproc_per_node:
            raise UsageError(f"launch: --nproc-per-node {nproc_per_node} but CUDA_VISIBLE_DEVICES lists "
                             f"{len(visible)} GPU(s)")
        env["CUDA_VISIBLE_DEVICES"] = visible[local_rank] if visible else str(local_rank)
    return env


class _Rank:
    """One launched process: its Popen, and the threads that copy its output lines with a `[rank]` prefix."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str]):
        self.rank = rank
        self.last: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.lock = threading.Lock()
        # a session of its own: a terminal's Ctrl-C reaches the launcher only, which passes it on once
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, bufsize=0)
        self.ended: float | None = None  # time.monotonic() when it exited (the first failure is the one to report)
        self.threads = [threading.Thread(target=self._copy, args=(self.proc.stdout, sys.stdout), daemon=True),
                        threading.Thread(target=self._copy, args=(self.proc.stderr, sys.stderr), daemon=True)]
        for t in self.threads:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    @property
    def failed(self) -> bool:
        return self.ended is not None and self.proc.returncode != 0

    def _copy(self, pipe, sink) -> None:
        prefix = f"[{self.rank}] "
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                self.last.append(line)
            sink.write(prefix + line + "\n")
            sink.flush()

    def drain(self) -> None:
        for t in self.threads:
            t.join(timeout=5)

    def signal(self, sig: int) -> None:
        if self.ended is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def exit_code(returncode: int) -> int:
    """A shell's exit code for a child's returncode (-N: killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _stop(ranks: list[_Rank], grace: float) -> None:
    for r in ranks:
        r.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(r.ended is None for r in ranks):
        time.sleep(POLL_S)
    for r in ranks:
        r.signal(signal.SIGKILL)
        r.proc.wait()


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"launch: --node-rank {args.node_rank} is not in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and not args.coordinator:
        raise UsageError("launch: --nnodes > 1 needs --coordinator HOST:PORT (node 0's address and a free port)")
    argv = command_line(args.cmd)
    coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
    n, total = args.nproc_per_node, args.nproc_per_node * args.nnodes
    ranks = [_Rank(args.node_rank * n + i, argv, process_environ(
        os.environ, coordinator=coordinator, num_processes=total, process_id=args.node_rank * n + i, local_rank=i,
        nproc_per_node=n)) for i in range(n)]

    forwarded: list[int] = []

    def forward(sig, _frame):
        forwarded.append(sig)
        for r in ranks:
            r.signal(sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            failures = sorted((r for r in ranks if r.failed), key=lambda r: r.ended)
            if forwarded:  # every process got the signal and stops by itself (a training run checkpoints first)
                if all(r.ended is not None for r in ranks):
                    for r in ranks:
                        r.drain()
                    return exit_code(failures[0].proc.returncode) if failures else 0
            elif failures:
                failed = failures[0]
                _stop([r for r in ranks if r is not failed], args.grace)
                for r in ranks:
                    r.drain()
                code = exit_code(failed.proc.returncode)
                print_error(f"launch: rank {failed.rank} exited with code {code}; the other processes were stopped. "
                            f"Its last lines:\n" + "\n".join(f"  [{failed.rank}] {line}" for line in failed.last))
                return code
            if all(r.ended is not None and r.proc.returncode == 0 for r in ranks):
                for r in ranks:
                    r.drain()
                return 0
            time.sleep(POLL_S)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for r in ranks:
            r.signal(signal.SIGKILL)
