"""XLA options a training config sets for its process: `use_cuda_graphs` (Surogate's key).

XLA on GPU replays runs of kernels as CUDA graphs ("command buffers", on by default for the command types in
`--xla_gpu_enable_command_buffer`); `use_cuda_graphs: false` turns them off with `--xla_gpu_enable_command_buffer=`
(an empty list), `true` or unset keeps XLA's default. CPU backends have no CUDA graphs and ignore the flag.

XLA reads XLA_FLAGS once, when JAX starts its backend: `apply_xla_options` sets the flag before that (the CLI calls
it right after loading the config, before anything touches a device). Once the backend is up a GPU process that
runs with the other setting is refused, naming what to set instead; so is `use_cuda_graphs: true` in a process
whose XLA_FLAGS already turn command buffers off.
"""
from __future__ import annotations

import os
import shlex
from collections.abc import Iterable

import jax

from surojax.config.schema import TrainConfig

COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


class XlaOptionsError(RuntimeError):
    is_user_error = True


def command_buffers_off(flags: str) -> bool:
    """Whether XLA_FLAGS text turns command buffers off (the flag given an empty list; the last one wins)."""
    value = None
    for word in shlex.split(flags):
        if word.startswith(COMMAND_BUFFERS_OFF.rstrip("=") + "="):
            value = word.split("=", 1)[1]
    return value == ""


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public way to ask without starting it

    return xla_bridge.backends_are_initialized()


def apply_xla_options(configs: Iterable[TrainConfig]) -> None:
    """Set (or check) the XLA flags the configs ask for; every stage of a run must agree (one process, one
    backend)."""
    wanted = {c.use_cuda_graphs for c in configs} - {None}
    if len(wanted) > 1:
        raise XlaOptionsError("use_cuda_graphs: the stages of this run disagree; XLA's setting is one per process")
    if not wanted:
        return
    graphs = wanted.pop()
    flags = os.environ.get("XLA_FLAGS", "")
    if command_buffers_off(flags) == (not graphs):
        return
    if graphs:
        raise XlaOptionsError(f"use_cuda_graphs: true, but XLA_FLAGS turns CUDA graphs off ({COMMAND_BUFFERS_OFF}); "
                              "remove that flag or the key")
    if _backend_started():
        if jax.default_backend() == "cpu":
            return  # nothing to capture on CPU
        raise XlaOptionsError("use_cuda_graphs: false must be set before JAX starts its GPU backend: run through "
                              f"the surojax CLI, or start the process with XLA_FLAGS='{COMMAND_BUFFERS_OFF}'")
    os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFERS_OFF}".strip()
