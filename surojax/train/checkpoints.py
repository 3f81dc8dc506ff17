"""Training checkpoints with orbax: trainable params, optimizer state, step, RNG key, data-iterator position.

Each checkpoint is a step folder under `<output_dir>/checkpoints/` written by orbax's CheckpointManager,
which writes to a temporary folder and renames it only once every item is on disk: a checkpoint that was
half-written when the process died is never listed, so `latest_step()` only ever returns a whole one; such an
unfinished temporary folder (`<step>.orbax-checkpoint-tmp-*`, left by a second Ctrl-C or a kill during a save)
is removed when a Checkpointer opens the directory (by process 0), and listed in `removed_unfinished` for the run
to say so.
`save_total_limit` keeps the newest N. `meta` and `array_metadata` read a checkpoint's JSON and its arrays'
names and shapes without restoring any array (train/checkpoint_match.py checks a checkpoint against the run).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


UNFINISHED = "*.orbax-checkpoint-tmp*"  # orbax's temporary name of a step folder until its save is complete


def unfinished_checkpoints(directory: str | Path) -> list[Path]:
    """The temporary folders of checkpoint saves that never finished in `directory`."""
    d = Path(directory)
    return sorted(d.glob(UNFINISHED)) if d.is_dir() else []


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int | None = None, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.removed_unfinished = unfinished_checkpoints(self.directory)
        if jax.process_index() == 0:  # (orbax's cleanup_tmp_directories does it too, but in the background)
            for p in self.removed_unfinished:
                shutil.rmtree(p, ignore_errors=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True, cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
        self.closed = False

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def meta(self, step: int) -> dict:
        """The JSON saved with checkpoint `step` (nothing else is read)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def array_metadata(self, step: int) -> dict[str, tuple[int, ...]]:
        """The saved arrays of checkpoint `step`: orbax's name (`trainable.layers.attn.q_proj.lora_a.value`) ->
        shape, from its metadata (no array is read)."""
        tree = self.manager.item_metadata(step)["state"]
        return {m.name: tuple(m.shape) for m in jax.tree.leaves(tree) if hasattr(m, "shape")}

    def save(self, step: int, state, meta: dict) -> None:
        """state: a pytree of arrays (params, optimizer state, rng key data); meta: JSON (data position ...)."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, like) -> tuple[object, dict]:
        """Restore into the structure, shapes, dtypes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the async writes, then stop orbax's threads (idempotent). An interpreter that exits while
        they run can abort (`terminate called without an active exception`)."""
        if self.closed:
            return
        self.manager.wait_until_finished()
        self.manager.close()
        self.closed = True


def key_to_array(key) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))
