"""Turn pydantic's ValidationError into short ConfigProblems: the YAML key, the bad value, what is allowed.

The schema is walked along each error's location to find the model (for the closest valid key of an unknown
key) and the annotation (for the choices of a Literal); pydantic's union tags are dropped from locations.
"""
from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from surojax.config.errors import ConfigProblem, format_key

Loc = tuple[str | int, ...]
Positions = dict[Loc, tuple[int, int] | None]  # YAML key path -> (line, column), 1-based; None: set by --override

# Keys users bring from Axolotl / HF that surojax spells differently (top level only; Surogate's own spellings
# are read as aliases: config/surogate.py).
RENAMED: dict[str, str] = {
    "base_model": "model", "model_name_or_path": "model", "lora_r": "lora_rank",
    "lora_target_linear": "lora_target_modules (all-linear)", "micro_batch_size": "per_device_train_batch_size",
    "batch_size": "per_device_train_batch_size", "lr": "learning_rate", "lr_scheduler": "lr_scheduler_type",
    "epochs": "num_epochs", "num_train_epochs": "num_epochs", "max_seq_length": "sequence_len",
    "seq_len": "sequence_len", "gradient_checkpointing": "recompute", "load_in_4bit": "qlora_bnb",
    "optim": "optimizer", "dataset": "datasets", "val_set_size": "validation_split_ratio", "warmup": "warmup_steps",
    "max_grad_norm_clip": "max_grad_norm",
}


def _strip_optional(ann: Any) -> Any:
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _strip_optional(rest[0])
    return ann


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _fields_by_key(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def resolve(root: type[BaseModel], loc: Loc) -> tuple[Loc, Any, type[BaseModel] | None]:
    """Walk `loc` through the schema. Returns (the loc without pydantic's union tags, the annotation at the
    end (None if unknown), the model that contains the last key (None if not a model field))."""
    ann: Any = root
    clean: list[str | int] = []
    parent: type[BaseModel] | None = None
    for item in loc:
        ann = _strip_optional(ann)
        origin = typing.get_origin(ann)
        if _is_model(ann):
            fields = _fields_by_key(ann)
            parent = ann
            clean.append(item)
            ann = fields[item].annotation if item in fields else None
        elif origin in (list, tuple, set) and isinstance(item, int):
            clean.append(item)
            ann, parent = typing.get_args(ann)[0], None
        elif origin is dict and not isinstance(item, int):
            clean.append(item)
            ann, parent = typing.get_args(ann)[1], None
        elif origin in (typing.Union, types.UnionType):
            continue  # a union member tag like 'bool' or 'str'
        else:
            clean.append(item)  # inside Any or a tag we do not know: keep it
            ann, parent = None, None
    return tuple(clean), ann, parent


def _choices(ann: Any) -> list[Any] | None:
    ann = _strip_optional(ann)
    if typing.get_origin(ann) is Literal:
        return list(typing.get_args(ann))
    return None


def _show(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _unknown_key(key: str, parent: type[BaseModel] | None, top_level: bool) -> str:
    if top_level and key in RENAMED:
        return f"unknown key; surojax calls it {RENAMED[key]}"
    valid = list(_fields_by_key(parent)) if parent else []
    lower = {k.lower(): k for k in valid}
    close = difflib.get_close_matches(str(key).lower(), list(lower), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {lower[close[0]]!r}?"
    if valid and len(valid) <= 16:
        return f"unknown key; valid keys here: {', '.join(valid)}"
    return "unknown key"


def _message(err: dict[str, Any], ann: Any, parent: type[BaseModel] | None, clean: Loc) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return _unknown_key(str(clean[-1]), parent, top_level=len(clean) == 1)
    if kind == "missing":
        return "required key is missing"
    if kind in ("literal_error", "enum"):
        choices = _choices(ann)
        allowed = ", ".join(str(c) for c in choices) if choices else err.get("ctx", {}).get("expected", "?")
        return f"{_show(value)} is not allowed; choose one of: {allowed}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping of keys (got {_show(value)})"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list (got {_show(value)})"
    msg = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    msg = msg.replace("Input should be", "must be")
    if kind.startswith("value_error") or "(got " in msg:
        return msg
    return f"{msg} (got {_show(value)})"


def _position(positions: Positions | None, loc: Loc) -> tuple[int | None, int | None, bool]:
    """(line, column, set_by_override) of `loc` or its nearest ancestor written in the YAML."""
    if positions:
        for n in range(len(loc), 0, -1):
            if loc[:n] in positions:
                pos = positions[loc[:n]]
                return (None, None, True) if pos is None else (pos[0], pos[1], False)
    return None, None, False


def user_loc(loc: Loc, origins: Mapping[Loc, Loc]) -> tuple[Loc, Loc | None]:
    """(the user's key for a surojax key, the surojax key it was read as, or None when the user wrote it);
    `origins`: config/surogate.py's Translation.origins."""
    for n in range(len(loc), 0, -1):
        if loc[:n] in origins:
            return origins[loc[:n]] + loc[n:], loc
    return loc, None


def problems_from_validation_error(
    exc: ValidationError, root: type[BaseModel], positions: Positions | None = None,
    origins: Mapping[Loc, Loc] | None = None,
) -> list[ConfigProblem]:
    """One ConfigProblem per distinct key, in the order pydantic reports them. `origins` (config/surogate.py): the
    user's key of each surojax key read from another spelling; such a problem is reported at the user's key."""
    merged: dict[Loc, list[str]] = {}
    for err in exc.errors(include_url=False):
        if err["type"] == "cross_field":
            for keys, message in err["ctx"]["problems"]:
                loc = tuple(err["loc"]) + (keys[0],)
                merged.setdefault(loc, []).append(message)
            continue
        clean, ann, parent = resolve(root, tuple(err["loc"]))
        msg = _message(err, ann, parent, clean)
        if msg not in merged.setdefault(clean, []):
            merged[clean].append(msg)
    out = []
    for loc, msgs in merged.items():
        line, col, overridden = _position(positions, loc)
        msg = "; ".join(msgs) + (" (set by --override)" if overridden else "")
        user, read_as = user_loc(loc, origins or {})
        if read_as is not None:
            msg += f" (read as {format_key(read_as)})"
        out.append(ConfigProblem(format_key(user), msg, line, col))
    return out
