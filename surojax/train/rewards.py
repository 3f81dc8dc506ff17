"""GRPO reward functions: loading them by name and scoring a batch of completions (TRL's conventions).

A reward function has TRL's signature

    f(prompts: list, completions: list, **columns) -> list[float | None]

one reward per completion; `columns` are the data rows' other columns (each a list aligned with `completions`),
and a function takes `**kwargs` for those it does not read. None means "does not apply to this completion" (a
math reward on a code prompt): it becomes NaN and is left out of the sums and means (TRL).

    functions = load_reward_functions(["exact_match", "my_rewards:brevity"], settings=RewardSettings())
    total, per_function = compute_rewards(functions, [1.0, 0.1], prompts, completions, {"answer": [...]})

Names: a built-in (`exact_match`, `format_regex`) or `module:function`, imported from PYTHONPATH or else from
the working directory (added to sys.path for the import: the module may import its own siblings later).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from surojax.config.grpo import BUILTIN_REWARDS as BUILTINS, GRPOSection
from surojax.train.generation_eval import is_correct
from surojax.wording import a_type

RewardCallable = Callable[..., Sequence[float | None]]


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded or returned something unusable; the message names it."""


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """The built-ins' settings: `exact_match_column` (the column exact_match compares with) and `format_regex`
    (the pattern format_regex searches for; needed only by that reward)."""

    exact_match_column: str = "answer"
    format_regex: str | None = None

    @classmethod
    def from_config(cls, section: GRPOSection) -> RewardSettings:
        return cls(exact_match_column=section.exact_match_column, format_regex=section.format_regex)


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A named reward function (the name is the one metrics are logged under: `rewards/<name>`)."""

    name: str
    fn: RewardCallable

    def __call__(self, prompts: Sequence, completions: Sequence, columns: Mapping[str, Sequence]) -> np.ndarray:
        """-> rewards [N] float64, NaN where the function returned None."""
        out = self.fn(prompts=list(prompts), completions=list(completions), **columns)
        try:
            values = [math.nan if r is None else float(r) for r in out]
        except (TypeError, ValueError) as e:
            raise RewardFunctionError(f"reward function {self.name!r} must return a list of floats or None, one "
                                      f"per completion ({e})") from None
        if len(values) != len(completions):
            raise RewardFunctionError(f"reward function {self.name!r} returned {len(values)} rewards for "
                                      f"{len(completions)} completions")
        return np.asarray(values, np.float64)


# ---- built-ins --------------------------------------------------------------------------------------------------

def completion_text(completion) -> str:
    """A completion as text: a string, or TRL's conversational form (a list of messages: the last one's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    raise RewardFunctionError(f"a completion must be a string or a list of messages; got {a_type(completion)}")


@dataclasses.dataclass(frozen=True)
class ExactMatch:
    """1.0 when the completion's answer equals the row's `column`, else 0.0; None where the row has no value.

    The comparison is the generation eval's (surojax.train.generation_eval.is_correct), so the reward is the
    accuracy the run reports: whitespace normalised; when the expected value holds a number, the last number of
    the completion is compared with it as a number ("Now Tom has 7." matches 7)."""

    column: str = "answer"

    def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        if self.column not in columns:
            raise RewardFunctionError(f"exact_match: the data has no column {self.column!r} (columns: "
                                      f"{', '.join(sorted(columns)) or 'none'}); set exact_match_column")
        return [None if want is None else float(is_correct(str(want), completion_text(c)))
                for c, want in zip(completions, columns[self.column], strict=True)]


@dataclasses.dataclass(frozen=True)
class FormatRegex:
    """1.0 when `pattern` is found in the completion (re.search, DOTALL), else 0.0."""

    pattern: str

    def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        compiled = re.compile(self.pattern, re.DOTALL)
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]


def builtin_reward(name: str, settings: RewardSettings) -> RewardCallable:
    if name == "exact_match":
        return ExactMatch(settings.exact_match_column)
    if name == "format_regex":
        if settings.format_regex is None:
            raise RewardFunctionError("format_regex: the reward needs its pattern (config key format_regex)")
        return FormatRegex(settings.format_regex)
    raise RewardFunctionError(f"{name!r} is not a built-in reward (exact_match, format_regex)")


# ---- loading ----------------------------------------------------------------------------------------------------

def _import(module_name: str, spec: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        if e.name is None or e.name.split(".")[0] != top:
            raise RewardFunctionError(f"reward function {spec!r}: importing {module_name} failed: {e}") from e
    cwd = os.getcwd()
    if cwd in sys.path:
        raise RewardFunctionError(f"reward function {spec!r}: no module {module_name!r} on PYTHONPATH or in the "
                                  f"working directory {cwd}")
    sys.path.append(cwd)  # the working directory, after PYTHONPATH (kept: the module may import siblings later)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise RewardFunctionError(f"reward function {spec!r}: no module {module_name!r} on PYTHONPATH or in the "
                                  f"working directory {cwd} ({e})") from e


def load_reward_function(spec: str, settings: RewardSettings = RewardSettings()) -> RewardFunction:
    """A built-in name or `module:function` -> RewardFunction (named by the built-in or the function's name)."""
    if spec in BUILTINS:
        return RewardFunction(spec, builtin_reward(spec, settings))
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(f"reward function {spec!r}: expected a built-in ({', '.join(BUILTINS)}) or "
                                  "module:function")
    module = _import(module_name, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardFunctionError(f"reward function {spec!r}: module {module_name} ({module.__file__}) has no "
                                  f"{attr!r}")
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {attr} is {a_type(fn)}, not callable")
    return RewardFunction(attr, fn)


def load_reward_functions(specs: Sequence[str], settings: RewardSettings = RewardSettings()) -> list[RewardFunction]:
    functions = [load_reward_function(s, settings) for s in specs]
    names = [f.name for f in functions]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RewardFunctionError(f"reward_functions: two functions are named {dupes[0]!r}; their metrics "
                                  "(rewards/<name>) would collide")
    return functions


# ---- scoring ----------------------------------------------------------------------------------------------------

def compute_rewards(functions: Sequence[RewardFunction], weights: Sequence[float] | None, prompts: Sequence,
                    completions: Sequence, columns: Mapping[str, Sequence]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Score N completions: -> (total [N], {name: rewards [N]}) float64.

    total = sum over functions of weight x reward, NaN rewards left out (TRL's nansum); a completion that every
    function left unscored (all NaN) gets NaN, which `surojax.losses.grpo.group_advantages` leaves out of its
    group's baseline and gives advantage 0. `weights` None: all 1.0. `columns` are lists aligned with the
    completions (a prompt's columns repeated for each of its generations)."""
    if not functions:
        raise ValueError("compute_rewards needs at least one reward function")
    weights = [1.0] * len(functions) if weights is None else list(weights)
    if len(weights) != len(functions):
        raise ValueError(f"{len(weights)} reward weights for {len(functions)} reward functions")
    for key, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(f"column {key!r} has {len(values)} values for {len(completions)} completions")
    per_function = {f.name: f(prompts, completions, columns) for f in functions}
    stacked = np.stack([per_function[f.name] for f in functions], axis=1)  # [N, F]
    total = np.nansum(stacked * np.asarray(weights, np.float64)[None, :], axis=1)
    total[np.isnan(stacked).all(axis=1)] = np.nan
    return total, per_function
