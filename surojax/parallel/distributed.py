"""Multi-process runs: `jax.distributed` initialised once, at process start, from the environment.

One JAX process drives the devices of one host (or one GPU); the processes of a run find each other through a
coordinator (process 0's host:port) and then see every device of every process in `jax.devices()`, so one mesh
spans them all. Where the numbers come from, first match wins:

    surojax launch      SUROJAX_COORDINATOR_ADDRESS (host:port of process 0's coordinator)
                        SUROJAX_NUM_PROCESSES       (processes in the run, all nodes)
                        SUROJAX_PROCESS_ID          (this process, 0 .. SUROJAX_NUM_PROCESSES - 1)
                        set by `surojax launch` (surojax/cli/launch.py); set them by hand for another launcher
    SLURM (srun)        SLURM_JOB_ID, SLURM_NTASKS > 1, SLURM_PROCID ... under `srun`: JAX's own cluster
                        detection picks the coordinator (the first node of the step), count, id and local GPU
    neither             one process; `jax.distributed` is not initialised

The CPU backend's cross-process collectives are gloo (`jax_cpu_collectives_implementation`), set before the
backends start; it only concerns the CPU client (GPU collectives are NCCL), so tests run N CPU processes here.

Failure: a process that dies stops sending heartbeats; after `SUROJAX_HEARTBEAT_TIMEOUT` seconds (default 100,
JAX's) the coordination service fails the others' pending collectives instead of letting them wait forever.
`surojax launch` and `srun --kill-on-bad-exit` stop the other processes sooner.

What the Trainer uses once the processes run: `row_block` (which rows of the global batch this process's devices
hold, so its loader reads only those), `global_batch` (the global arrays from those rows), `gather_to_main` (an
export's weights on process 0), `barrier` (after process 0 alone wrote files) and `max_over_processes` (a signal
any process got stops all at the same step).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

COORDINATOR_ENV = "SUROJAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "SUROJAX_NUM_PROCESSES"
PROCESS_ID_ENV = "SUROJAX_PROCESS_ID"
HEARTBEAT_ENV = "SUROJAX_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_S = 100
SLURM_REQUIRED = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


class DistributedSetupError(ValueError):
    """Distributed environment variables that do not make a run."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """Where this process stands in the run. `source`: "launch", "slurm" or "single"."""

    process_id: int
    num_processes: int
    source: str
    coordinator: str | None = None  # host:port (None: single process, or left to JAX's SLURM detection)

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes logs, metrics and exports."""
        return self.process_id == 0


def process_env(environ: Mapping[str, str] = os.environ) -> ProcessEnv:
    """Read the run's process layout from `environ` (pure: nothing is initialised)."""
    launch = [k for k in (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV) if k in environ]
    if launch:
        if len(launch) != 3:
            missing = sorted({COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV} - set(launch))
            raise DistributedSetupError(f"{', '.join(launch)} set but not {', '.join(missing)}: a multi-process run "
                                        "needs all three (surojax launch sets them)")
        try:
            count, pid = int(environ[NUM_PROCESSES_ENV]), int(environ[PROCESS_ID_ENV])
        except ValueError:
            raise DistributedSetupError(f"{NUM_PROCESSES_ENV}={environ[NUM_PROCESSES_ENV]!r} and {PROCESS_ID_ENV}="
                                        f"{environ[PROCESS_ID_ENV]!r} must be integers") from None
        if count < 1 or not 0 <= pid < count:
            raise DistributedSetupError(f"{PROCESS_ID_ENV}={pid} is not in [0, {NUM_PROCESSES_ENV}={count})")
        return ProcessEnv(pid, count, "launch", environ[COORDINATOR_ENV])
    if all(k in environ for k in SLURM_REQUIRED) and int(environ["SLURM_NTASKS"]) > 1:
        return ProcessEnv(int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]), "slurm")
    return ProcessEnv(0, 1, "single")


def initialize_from_env(environ: Mapping[str, str] = os.environ) -> ProcessEnv:
    """Initialise `jax.distributed` for the run the environment describes (see the module docstring); call once,
    at process start, before anything touches a device. A single process initialises nothing. Processes other
    than 0 then log warnings and errors only. Idempotent: a second call returns the layout it started with."""
    env = process_env(environ)
    if env.num_processes == 1:
        return env
    if jax.distributed.is_initialized():
        return env
    heartbeat = environ.get(HEARTBEAT_ENV, str(DEFAULT_HEARTBEAT_S))
    if not heartbeat.isdigit() or int(heartbeat) < 1:
        raise DistributedSetupError(f"{HEARTBEAT_ENV}={heartbeat!r}: expected a whole number of seconds >= 1")
    # only the CPU client reads it (GPU collectives are NCCL); must be set before the backends start
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if env.source == "launch":
        jax.distributed.initialize(coordinator_address=env.coordinator, num_processes=env.num_processes,
                                   process_id=env.process_id, heartbeat_timeout_seconds=int(heartbeat))
    else:  # SLURM: JAX detects the coordinator, count, id and this task's local GPU
        jax.distributed.initialize(heartbeat_timeout_seconds=int(heartbeat))
    if not env.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    log.info("process %d of %d (%s), %d local / %d global devices", env.process_id, env.num_processes, env.source,
             jax.local_device_count(), jax.device_count())
    return env


def is_main_process() -> bool:
    """Whether this is process 0 (always, in a single-process run)."""
    return jax.process_index() == 0


@dataclasses.dataclass(frozen=True)
class RowBlock:
    """The rows of a global batch this process's devices hold: block `index` of `count` equal, contiguous blocks.
    Processes holding the same rows (e.g. pipeline stages of one data shard) share a block: `count` is the
    number of distinct blocks, at most the process count, 1 in a single process."""

    index: int
    count: int


def row_block(sharding: jax.sharding.Sharding, shape: tuple[int, ...], axis: int) -> RowBlock:
    """This process's `RowBlock` of an array of `shape` placed by `sharding`, along the batch `axis`. An error when
    the mesh gives a process rows that are not one contiguous block of the same size as every other process's."""
    size = shape[axis]
    parts: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        parts.setdefault(device.process_index, set()).add(index[axis].indices(size)[:2])
    spans = {}
    for process, ranges in parts.items():
        start, stop = min(a for a, _ in ranges), max(b for _, b in ranges)
        if sum(b - a for a, b in _merged(ranges)) != stop - start:
            raise DistributedSetupError(f"the mesh gives process {process} batch rows {sorted(ranges)} that are not "
                                        "one contiguous block; order the mesh so each process's devices are adjacent")
        spans[process] = (start, stop)
    widths = {stop - start for start, stop in spans.values()}
    width = max(widths)
    if len(widths) != 1 or any(start % width for start, _ in spans.values()):
        raise DistributedSetupError(f"the processes hold unequal batch row blocks {sorted(spans.values())}")
    return RowBlock(spans[jax.process_index()][0] // width, size // width)


def _merged(ranges: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def global_batch(local: dict[str, np.ndarray], sharding: jax.sharding.Sharding, batch_axis: int,
                 blocks: int) -> dict[str, jax.Array]:
    """The global batch arrays from this process's rows of them: `local[k]` holds its `RowBlock` along
    `batch_axis` (the loaders give block g of G rows g, g + G, ... of each global batch, surojax/data/loader.py);
    the global array has `blocks` (G) times as many rows there. All processes call it with the same keys and
    shapes. One process: a plain device_put."""
    def one(x: np.ndarray) -> jax.Array:
        shape = list(x.shape)
        shape[batch_axis] *= blocks
        return jax.make_array_from_process_local_data(sharding, x, tuple(shape))
    return {k: one(v) for k, v in local.items()}


def gather_to_main(tree):
    """The values of a pytree of (possibly process-spanning) arrays as numpy, on process 0; None on the others.
    Every process must call it (each non-addressable leaf is one all-gather, in the tree's order); one leaf at a
    time is materialised on the other processes' hosts, the whole tree only on process 0's."""
    leaves, treedef = jax.tree.flatten(tree)
    main = is_main_process()
    kept = []
    for x in leaves:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        if main:
            kept.append(np.asarray(x) if isinstance(x, jax.Array) else x)
    return jax.tree.unflatten(treedef, kept) if main else None


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (e.g. after process 0 alone wrote or removed files the
    others then read). Nothing to wait for in a single process."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def max_over_processes(value: int) -> int:
    """The largest of every process's `value` (every process must call it: one small all-gather); `value` itself in
    a single process. E.g. the signal number any process received, so that all stop at the same step."""
    if jax.process_count() == 1:
        return value
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int32))))
