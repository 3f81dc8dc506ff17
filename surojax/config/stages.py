"""Multi-stage configs: one YAML, several training runs in order (e.g. pretrain from scratch, then LoRA on it).

    stages:
      - name: pretrain
        from_scratch: true
        model_config: {model_type: qwen3, hidden_size: 128, ...}
        datasets: [{path: corpus.jsonl, type: text}]
        output_dir: runs/demo/pretrain
      - name: lora
        model: runs/demo/pretrain/model      # written by the stage before: need not exist yet
        lora: true
        datasets: [{path: qa.jsonl, type: instruction}]
        output_dir: runs/demo/lora
    recipe: fp32                             # any other top-level key: a default shared by every stage
    tokenizer: my_tokenizer

Merging: a stage's own value wins over the shared default; mappings (model_config, parallel, eval_generation ...)
are merged key by key, lists (datasets ...) are replaced. Stage-only keys, which are not TrainConfig keys:
    name                  the stage's name in logs and errors (default `stage<i>`); unique
    overwrite_output_dir  before the stage runs, delete what an earlier run left in its output_dir (only the
                          files and folders training writes there, see OUTPUT_ARTIFACTS; anything else stays);
                          the command line's `--overwrite` sets it in every stage
Without it, nothing an earlier run wrote is replaced: a stage whose exports all exist (`Stage.is_complete`) is
skipped when the run starts (train/stages.py says so and reports its saved results), and a stage whose output_dir
holds only part of them is an error that names the folder and `--overwrite`.
Command-line overrides: `stages.1.max_steps=2` sets one stage's key; any other key (`max_steps=2`) is set in
every stage and wins over the stage's own value.

Every stage is validated as a full TrainConfig, and the paths of every stage are checked, before any stage
runs. A path that an earlier stage will write (`<output_dir>/model` of a full or from-scratch stage,
`<output_dir>/adapter` of a LoRA stage, `<output_dir>/merged` with merge_adapter, and anything inside them) may
not exist yet; every other missing path is an error. Problems name the stage: `stages[1].lora_rank: ...`.
A YAML without `stages:` is one plain TrainConfig (`load_config`); `load_run` takes either kind.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from surojax.config.errors import ConfigError, ConfigProblem
from surojax.config.explain import Loc, Positions
from surojax.config.load import apply_overrides, load_config, parse_override, read_config_file, validated
from surojax.config.paths import check_paths, dataset_problem
from surojax.config.schema import TrainConfig

# What a training run writes into its output_dir; overwrite_output_dir deletes these and nothing else.
OUTPUT_ARTIFACTS = ("model", "adapter", "merged", "checkpoints", "metrics.jsonl", "loss.png", "tensorboard",
                    "wandb", "generation_eval.json", "adapter_config.json", "adapter_model.safetensors")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training run of a (possibly multi-stage) config. `index` is None for a plain config."""

    name: str | None
    config: TrainConfig
    index: int | None = None
    overwrite_output_dir: bool = False

    @property
    def key(self) -> str:
        """How problems name this stage: `stages[1]` ('' for a plain config)."""
        return "" if self.index is None else f"stages[{self.index}]"

    def is_complete(self) -> bool:
        """Whether an earlier run finished this stage: every export folder exists and is not empty (exports
        are written under a temporary name and renamed, so a folder that exists is whole)."""
        return all(p.is_dir() and any(p.iterdir()) for p in self.outputs())

    def outputs(self) -> dict[Path, str]:
        """The folders this stage exports at its end -> their kind ('model' or 'adapter')."""
        out = Path(self.config.output_dir)
        if not self.config.lora:
            return {_resolved(out / "model"): "model"}
        made = {_resolved(out / "adapter"): "adapter"}
        if self.config.merge_adapter:
            made[_resolved(out / "merged")] = "model"
        return made


def _resolved(p: str | os.PathLike) -> Path:
    return Path(p).expanduser().resolve()


def is_staged(data: Any) -> bool:
    return isinstance(data, Mapping) and "stages" in data


def merge_defaults(shared: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """`own` over `shared`: mappings merged key by key, everything else (lists too) replaced."""
    out = copy.deepcopy(dict(shared))
    for k, v in own.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge_defaults(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _parse_key(key: str) -> Loc:
    """'datasets[0].path' -> ('datasets', 0, 'path') (the inverse of errors.format_key)."""
    out: list[str | int] = []
    for part in key.split("."):
        name, *idx = re.split(r"\[(\d+)\]", part)
        if name:
            out.append(name)
        out += [int(i) for i in idx if i != ""]
    return tuple(out)


def _stage_positions(positions: Positions | None, i: int) -> Positions:
    """Key positions as seen by stage i: the shared keys', then the stage's own (which win)."""
    if not positions:
        return {}
    out: Positions = {loc: p for loc, p in positions.items() if loc and loc[0] != "stages"}
    prefix = ("stages", i)
    out.update({loc[2:]: p for loc, p in positions.items() if loc[:2] == prefix and len(loc) > 2})
    return out


def _rekey(p: ConfigProblem, i: int, name: str) -> ConfigProblem:
    key = f"stages[{i}]" + (f".{p.key}" if p.key else "")
    return ConfigProblem(key, f"{p.message} (stage {name!r})", p.line, p.column)


def stages_from_dict(data: Mapping[str, Any], source: str | None = None, positions: Positions | None = None,
                     overrides: Iterable[str] = ()) -> list[Stage]:
    """Validate every stage of a staged config dict; all problems of all stages are raised together.

    `overrides` are the non-`stages.` command-line overrides, set in every stage after merging."""
    stages_raw = data.get("stages")
    top = positions or {}
    if not isinstance(stages_raw, list) or not stages_raw:
        raise ConfigError(ConfigProblem("stages", "must be a non-empty list of stage mappings",
                                        *(top.get(("stages",)) or (None, None))), source)
    overrides = list(overrides)
    set_by = [parse_override(o)[0] for o in overrides]
    shared = {k: v for k, v in data.items() if k != "stages"}
    problems: list[ConfigProblem] = []
    if "name" in shared:
        problems.append(ConfigProblem("name", "a stage's name goes inside its entry under `stages:`",
                                      *(top.get(("name",)) or (None, None))))
    stages: list[Stage] = []
    seen_names: dict[str, int] = {}
    for i, entry in enumerate(stages_raw):
        pos = _stage_positions(positions, i)
        where = lambda loc: pos.get(loc) or (None, None)  # noqa: E731
        if not isinstance(entry, Mapping):
            problems.append(ConfigProblem(f"stages[{i}]", f"must be a mapping of config keys (got "
                                          f"{type(entry).__name__})", *(top.get(("stages", i)) or (None, None))))
            continue
        merged = merge_defaults(shared, entry)
        name = merged.pop("name", None)
        name = f"stage{i}" if name is None else name
        overwrite = merged.pop("overwrite_output_dir", False)
        if not isinstance(name, str) or not _NAME.match(name):
            problems.append(ConfigProblem(f"stages[{i}].name", f"must be a word of letters, digits, _ . - "
                                          f"(got {name!r})", *where(("name",))))
            name = f"stage{i}"
        elif name in seen_names:
            problems.append(ConfigProblem(f"stages[{i}].name", f"{name!r} is already the name of stages"
                                          f"[{seen_names[name]}]", *where(("name",))))
        seen_names.setdefault(name, i)
        if not isinstance(overwrite, bool):
            problems.append(ConfigProblem(f"stages[{i}].overwrite_output_dir", f"must be true or false (got "
                                          f"{overwrite!r})", *where(("overwrite_output_dir",))))
            overwrite = False
        if overrides:
            merged = apply_overrides(merged, overrides)
            pos = {k: v for k, v in pos.items() if not any(k[: len(o)] == o for o in set_by)}
            pos.update((loc, None) for loc in set_by)
        cfg, found = validated(merged, pos)
        if cfg is None:
            problems += [_rekey(p, i, name) for p in found]
            continue
        stages.append(Stage(name, cfg, i, overwrite))
    if not problems:
        problems += _output_dir_clashes(stages, positions)
    if problems:
        raise ConfigError(problems, source)
    return stages


def _line(positions: Positions | None, stage: Stage, loc: Loc) -> tuple[int | None, int | None]:
    pos = _stage_positions(positions, stage.index) if stage.index is not None else (positions or {})
    for n in range(len(loc), 0, -1):
        if pos.get(loc[:n]):
            return pos[loc[:n]]
    return None, None


def _output_dir_clashes(stages: list[Stage], positions: Positions | None) -> list[ConfigProblem]:
    out, seen = [], {}
    for s in stages:
        d = _resolved(s.config.output_dir)
        if d in seen:
            out.append(ConfigProblem(f"{s.key}.output_dir", f"{s.config.output_dir!r} is also the output_dir of "
                                     f"stage {seen[d]!r}; give each stage its own (stage {s.name!r})",
                                     *_line(positions, s, ("output_dir",))))
        seen.setdefault(d, s.name)
    return out


def _produced_by(path: str | None, produced: dict[Path, tuple[str, str]]) -> tuple[Path, str, str] | None:
    """(export folder, stage name, kind) when `path` is an export folder of an earlier stage or inside one."""
    if path is None:
        return None
    p = _resolved(path)
    for folder, (stage, kind) in produced.items():
        if p == folder or folder in p.parents:
            return folder, stage, kind
    return None


def stage_path_problems(stage: Stage, produced: dict[Path, tuple[str, str]] | None = None,
                        positions: Positions | None = None) -> list[ConfigProblem]:
    """Missing paths of one stage (`check_paths` plus eval_generation.path and a finished output_dir), except
    those that `produced` (export folder -> (stage name, kind), from earlier stages) will hold."""
    cfg, produced = stage.config, produced or {}
    out: list[ConfigProblem] = []
    blank: dict[str, Any] = {}
    for key, want in (("model", "model"), ("adapter_path", "adapter"), ("tokenizer", None)):
        hit = _produced_by(getattr(cfg, key), produced)
        if hit is None:
            continue
        folder, by, kind = hit
        blank[key] = None
        if want is not None and kind != want:
            what = "a LoRA adapter" if kind == "adapter" else "a full model"
            hint = "adapter_path" if kind == "adapter" else "model"
            out.append(ConfigProblem(key, f"stage {by!r} writes {what} to {folder}, which belongs under `{hint}:`"))
    for key in ("model", "adapter_path", "tokenizer"):
        value = getattr(cfg, key)
        if value is None or key in blank:
            continue
        for s_folder, (by, _) in produced.items():
            if _resolved(value) == s_folder.parent and not Path(value).expanduser().exists():
                out.append(ConfigProblem(key, f"{value!r} is the output_dir of stage {by!r}, which writes its "
                                         f"{s_folder.name} to {s_folder}"))
                blank[key] = None
    try:
        check_paths(cfg.model_copy(update=blank) if blank else cfg)
    except ConfigError as e:
        out += e.problems
    if cfg.eval_generation is not None:
        why = dataset_problem(cfg.eval_generation)
        if why is not None:
            out.append(ConfigProblem("eval_generation.path", why))
    if (stage.index is not None and not stage.overwrite_output_dir and not cfg.resume_from_checkpoint
            and not stage.is_complete()):
        # (a complete stage is skipped; a plain config leaves this to the Trainer, as before stages existed)
        done = [Path(cfg.output_dir) / d for d in ("model", "adapter") if (Path(cfg.output_dir) / d).exists()]
        if done:
            out.append(ConfigProblem("output_dir", f"{cfg.output_dir} already holds a trained {done[0].name} "
                                     f"({done[0]}) from an earlier run; choose another output_dir, or pass "
                                     "--overwrite (overwrite_output_dir: true) to replace it"))
    located = []
    for p in out:
        line, col = (p.line, p.column) if p.line is not None else _line(positions, stage, _parse_key(p.key))
        if stage.index is not None:
            located.append(ConfigProblem(f"{stage.key}.{p.key}", f"{p.message} (stage {stage.name!r})", line, col))
        else:
            located.append(ConfigProblem(p.key, p.message, line, col))
    return located


def check_stage_paths(stages: list[Stage], source: str | None = None, positions: Positions | None = None) -> None:
    """Check the paths of every stage in order (module docstring); raise one ConfigError naming them all."""
    produced: dict[Path, tuple[str, str]] = {}
    problems: list[ConfigProblem] = []
    for stage in stages:
        problems += stage_path_problems(stage, produced, positions)
        produced.update({folder: (stage.name or "stage", kind) for folder, kind in stage.outputs().items()})
    if problems:
        raise ConfigError(problems, source)


def load_stages(path: str | os.PathLike[str], overrides: Iterable[str] = (), *, check_paths: bool = True,
                overwrite: bool = False) -> list[Stage]:
    """Read and validate a staged YAML (every stage, and with check_paths every stage's paths).
    `overwrite` (the command line's --overwrite) sets overwrite_output_dir in every stage."""
    data, positions, source = read_config_file(path)
    if not is_staged(data):
        raise ConfigError(ConfigProblem("stages", "this config has no `stages:` list (load it with load_config)"),
                          source)
    overrides = list(overrides)
    own = [o for o in overrides if parse_override(o)[0][:1] == ("stages",)]
    rest = [o for o in overrides if o not in own]
    if own:
        data = apply_overrides(data, own)
        set_by = [parse_override(o)[0] for o in own]
        positions = {k: v for k, v in positions.items() if not any(k[: len(o)] == o for o in set_by)}
        positions.update((loc, None) for loc in set_by)
    stages = stages_from_dict(data, source, positions, rest)
    if overwrite:
        stages = [dataclasses.replace(s, overwrite_output_dir=True) for s in stages]
    if check_paths:
        check_stage_paths(stages, source, positions)
    return stages


def load_run(path: str | os.PathLike[str], overrides: Iterable[str] = (), *, check_paths: bool = True,
             overwrite: bool = False) -> list[Stage]:
    """The stages of a staged YAML, or a plain YAML as one Stage (name None, index None)."""
    data, _, source = read_config_file(path)
    if is_staged(data):
        return load_stages(path, overrides, check_paths=check_paths, overwrite=overwrite)
    cfg = load_config(path, overrides)
    stage = Stage(None, cfg, overwrite_output_dir=overwrite)
    if check_paths:
        problems = stage_path_problems(stage)
        if problems:
            raise ConfigError(problems, source)
    return [stage]


def select_stage(stages: list[Stage], ref: str | None, source: str | None = None) -> Stage:
    """The stage named `ref` or at index `ref` (`--stage NAME|N` of export and tokenize); a plain config's one
    stage when `ref` is None. A multi-stage config without `ref` is an error that lists the stage names."""
    names = ", ".join(f"{s.index}={s.name}" for s in stages)
    if ref is None:
        if len(stages) == 1:
            return stages[0]
        raise ConfigError(ConfigProblem("stages", f"this config has {len(stages)} stages ({names}): pass "
                                        "--stage NAME or --stage N"), source)
    for s in stages:
        if s.name == ref or (ref.isdigit() and s.index == int(ref)):
            return s
    raise ConfigError(ConfigProblem("stages", f"--stage {ref}: no such stage (the stages are {names})"
                                    if stages[0].index is not None else
                                    f"--stage {ref}: this config has no `stages:` list"), source)
