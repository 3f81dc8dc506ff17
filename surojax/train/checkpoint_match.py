"""Whether a checkpoint belongs to the run reading it back (resume, `surojax export`), checked before orbax
restores any array, so that a mismatch is a named error instead of orbax's TensorStore traceback.

    step = open_step(path)                   # a --checkpoint / resume_from_checkpoint path -> its step, or an
                                             # error naming the steps that exist
    changes = check(checkpointer, step, cfg, like)   # raises CheckpointMismatchError, else the accepted changes
    for c in changes: print(c)               # "learning_rate: 0.001 -> 0.002"

Each checkpoint's meta holds the config of the run that wrote it (`config_record`). Reading one back compares
it with the config at hand, key by key (dotted keys into mappings, `model_config.hidden_size`), except the keys
that only point at checkpoints (`checkpoint_dir`, `resume_from_checkpoint`); a changed `output_dir` says that the
checkpoint is another run's (or a moved one):
- FIXED_KEYS decide what the trained weights are (the base model and architecture, the adapters' shape, scale and
  targets, the trainer): a change is an error naming each such key with the checkpoint's value and the config's;
- every other change (learning_rate, max_steps, save_steps ...) is accepted and returned for the run to announce.
Then the checkpoint's arrays (orbax's names and shapes, from its metadata) are matched with the run's: an array
missing, extra or of another shape is the same named error (the first few of them, and every changed key), which
also covers a change outside FIXED_KEYS that reshapes the state (another optimizer) and a checkpoint written
before configs were recorded.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from surojax.config.schema import TrainConfig
from surojax.train.checkpoints import Checkpointer

# where the checkpoints are: never compared
LOCATION_KEYS = ("checkpoint_dir", "resume_from_checkpoint")
# what the trained weights are: a checkpoint is read back only with the values it was written with
FIXED_KEYS = ("trainer", "model", "tokenizer", "from_scratch", "model_config", "lora", "lora_rank", "lora_alpha",
              "use_rslora", "lora_target_modules", "train_router", "train_vision", "adapter_path",
              "adapter_init_mode")
CONFIG_META_KEY = "config"  # the key of the run's config in a checkpoint's meta


class CheckpointMismatchError(ValueError):
    """A checkpoint that cannot be read back by this run (another run's, or a changed key that shapes it)."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class Change:
    key: str  # dotted: `lora_rank`, `model_config.hidden_size`
    old: Any  # the checkpoint's run's value
    new: Any  # the config's

    @property
    def fixed(self) -> bool:
        return self.key.split(".")[0] in FIXED_KEYS

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    text = "(not set)" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


def config_record(cfg: TrainConfig) -> dict:
    """The config as a checkpoint's meta keeps it: its YAML keys, JSON values."""
    return cfg.model_dump(mode="json", by_alias=True)


def _flat(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: Mapping, cfg: TrainConfig) -> list[Change]:
    """The keys whose value in `cfg` differs from the checkpoint's run's (`saved`: its `config_record`), in the
    config's key order; keys only one side knows (another version of surojax) and LOCATION_KEYS are skipped."""
    old = {k: v for k, v in saved.items() if k not in LOCATION_KEYS}
    new = {k: v for k, v in config_record(cfg).items() if k not in LOCATION_KEYS}
    out = []
    for top in new:
        if top not in old:
            continue
        a, b = _flat({top: old[top]}), _flat({top: new[top]})
        for key in dict.fromkeys([*b, *a]):
            if a.get(key) != b.get(key):
                out.append(Change(key, a.get(key), b.get(key)))
    return out


def open_step(path: str | Path) -> int:
    """The step of a step folder (`<checkpoint_dir>/<step>`, a --checkpoint or resume_from_checkpoint path); an
    error naming the steps that exist when it is no whole checkpoint."""
    path = Path(path)
    if path.is_dir() and not path.name.isdigit():
        found = _steps(path)
        if found:
            raise CheckpointMismatchError(f"checkpoint {path}: a checkpoint folder, not one of its steps; its steps "
                                          f"are {', '.join(map(str, found))} (pass {path / str(found[-1])} for the "
                                          "latest)")
    if not path.parent.is_dir():
        raise CheckpointMismatchError(f"checkpoint {path}: no such checkpoint; {path.parent} does not exist")
    steps = _steps(path.parent)
    if not path.name.isdigit() or int(path.name) not in steps:
        there = (f"the checkpoints in {path.parent} are steps {', '.join(map(str, steps))}" if steps else
                 f"{path.parent} holds no checkpoint")
        raise CheckpointMismatchError(f"checkpoint {path}: no such checkpoint; {there}")
    return int(path.name)


def _steps(directory: Path) -> list[int]:
    """The whole checkpoints' steps in `directory`: its folders named by a step alone (orbax renames a save's
    temporary folder to that only once it is complete). Read only: nothing is created or removed."""
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _array_names(like) -> dict[str, tuple[int, ...]]:
    """The arrays of a state pytree as orbax names them in a checkpoint -> shape."""
    return {name: tuple(leaf.shape) for name, leaf in ocp.tree.to_flat_dict(like, sep=".").items()
            if hasattr(leaf, "shape")}


def check(checkpointer: Checkpointer, step: int, cfg: TrainConfig, like) -> list[Change]:
    """Match checkpoint `step` with the run of `cfg` whose state has the structure and shapes of `like` (module
    docstring). Raises CheckpointMismatchError; returns the accepted changes (to announce)."""
    where = checkpointer.directory / str(step)
    saved = checkpointer.meta(step).get(CONFIG_META_KEY)
    changes = config_changes(saved, cfg) if isinstance(saved, Mapping) else []
    fixed = [c for c in changes if c.fixed]
    moved = [c for c in changes if c.key == "output_dir"]
    origin = f" (written by the run in {moved[0].old})" if moved else ""
    if fixed:
        raise CheckpointMismatchError("\n".join([
            f"checkpoint {where}{origin} does not fit this config: these keys decide what its weights are",
            *(f"  {c.key}: {_show(c.old)} in the checkpoint's run, {_show(c.new)} in this config" for c in fixed),
            "set them back to the checkpoint's values (its run's config), or start a new run in another output_dir "
            "(or pass --overwrite to replace this one)"]))
    have, want = checkpointer.array_metadata(step), _array_names(like)
    problems = [f"  {n}: {list(have[n])} in the checkpoint, {list(want[n])} in this run"
                for n in want if n in have and have[n] != want[n]]
    problems += [f"  {n}: not in the checkpoint" for n in want if n not in have]
    problems += [f"  {n}: in the checkpoint, not in this run" for n in have if n not in want]
    if problems:
        what = ("what changed since the checkpoint's run: " + "; ".join(map(str, changes)) if changes else
                "its run's config is not recorded in it (an older checkpoint)" if saved is None else
                "no key of the config changed")
        raise CheckpointMismatchError("\n".join([
            f"checkpoint {where}{origin} does not fit this run: {len(problems)} of its arrays differ", *problems[:5],
            *([f"  ... and {len(problems) - 5} more"] if len(problems) > 5 else []), what]))
    return changes
