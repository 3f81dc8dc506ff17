"""Load a TrainConfig from YAML (+ dotted overrides) or a dict; every problem becomes one ConfigError.

    cfg = load_config("configs/examples/lora_qwen3.yaml", ["learning_rate=1e-4", "datasets.0.samples=100"])

YAML is read with PyYAML's safe loader, two fixes added: `1e-4` is a float (YAML 1.1 wants `1.0e-4`), and a
key written twice in one mapping is an error instead of silently keeping the last. A line that YAML refuses
because a tab indents it (YAML indents with spaces only; Surogate's documented example has such lines, a Markdown
habit) is read with each leading tab as 4 columns, Markdown's tab stop, and a warning names the line. Override
values are YAML scalars (or flow YAML like `[q_proj, v_proj]`). Surogate's spellings are read as surojax's
before validation (config/surogate.py).
"""
from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from surojax.config.errors import ConfigError, ConfigProblem, format_key
from surojax.config.explain import Loc, Positions, problems_from_validation_error
from surojax.config.schema import TrainConfig
from surojax.config.surogate import named_spellings, translate

log = logging.getLogger(__name__)
TAB_STOP = 4  # Markdown's (CommonMark): where the tab-indented YAML in Surogate's docs comes from

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _positions(node: yaml.Node | None, loc: Loc = (), out: Positions | None = None) -> Positions:
    """Map each key path written in the YAML to its (line, column), 1-based."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = loc + (key_node.value,)
            out[sub] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _positions(value_node, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[loc + (i,)] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _positions(item, loc + (i,), out)
    return out


def _tab_indented_line(e: yaml.MarkedYAMLError, lines: list[str]) -> int | None:
    """The 0-based line YAML refused for a tab in its indentation, else None."""
    mark = e.problem_mark
    if mark is None or "'\\t'" not in str(e.problem) or mark.line >= len(lines):
        return None
    line = lines[mark.line]
    return mark.line if "\t" in line[:len(line) - len(line.lstrip())] else None


def _expand_tabs(line: str) -> str:
    indent = line[:len(line) - len(line.lstrip())]
    return indent.expandtabs(TAB_STOP) + line[len(indent):]


def parse_yaml(text: str, source: str | None = None) -> tuple[Any, Positions]:
    """YAML text -> (data, key positions). A syntax error names the file, line and column; a line indented with
    tabs is read with Markdown's tab stop (4 columns), with a warning (module docstring)."""
    lines = text.split("\n")
    while True:
        try:
            return _parse_yaml(text, source)
        except _TabIndented as tab:
            where = (source or "config", tab.line + 1)
            if where not in _TABS_WARNED:  # once per line: a run reads its config more than once
                _TABS_WARNED.add(where)
                log.warning("%s:%d: indented with a tab, which YAML does not allow; read as %d spaces a tab",
                            *where, TAB_STOP)
            lines[tab.line] = _expand_tabs(lines[tab.line])
            text = "\n".join(lines)


_TABS_WARNED: set[tuple[str, int]] = set()


class _TabIndented(Exception):
    def __init__(self, line: int):
        self.line = line


def _parse_yaml(text: str, source: str | None) -> tuple[Any, Positions]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        tab = _tab_indented_line(e, text.split("\n"))
        if tab is not None:
            raise _TabIndented(tab) from None
        mark = e.problem_mark or e.context_mark
        what = " ".join(str(s) for s in (e.context, e.problem) if s) or "invalid YAML"
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError(ConfigProblem("", f"YAML syntax error: {what}", line, col), source) from None
    except yaml.YAMLError as e:
        raise ConfigError(ConfigProblem("", f"YAML error: {e}"), source) from None
    finally:
        loader.dispose()
    return data, _positions(node)


def parse_override(item: str) -> tuple[Loc, Any]:
    """'datasets.0.path=x' -> (('datasets', 0, 'path'), 'x'). The value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(ConfigProblem("", f"override {item!r} must look like key=value (e.g. learning_rate=1e-4)"),
                          "--override")
    try:
        value, _ = parse_yaml(raw)
    except ConfigError:
        value = raw  # not valid YAML on its own (e.g. 'a: b'): take it as a plain string
    loc = tuple(int(p) if p.isdigit() else p for p in key.split("."))
    return loc, value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Set each `key.path=value` in a copy of `data`. Missing mappings are created; a list index may be the
    list's length (append). Keys are not checked here: the schema names unknown ones."""
    data = copy.deepcopy(data)
    for item in overrides:
        loc, value = parse_override(item)
        node: Any = data
        for i, part in enumerate(loc):
            last = i == len(loc) - 1
            here = format_key(loc[: i + 1])
            if isinstance(node, dict):
                if isinstance(part, int):
                    part = str(part)
                if last:
                    node[part] = value
                else:
                    nxt = node.get(part)
                    if nxt is None:
                        nxt = node[part] = [] if isinstance(loc[i + 1], int) else {}
                    node = nxt
            elif isinstance(node, list):
                if not isinstance(part, int) or part > len(node):
                    raise ConfigError(ConfigProblem(here, f"override {item!r}: index out of range (the list has "
                                                    f"{len(node)} items)"), "--override")
                if part == len(node):
                    node.append({} if not last else None)
                if last:
                    node[part] = value
                else:
                    if node[part] is None:
                        node[part] = {}
                    node = node[part]
            else:
                raise ConfigError(ConfigProblem(format_key(loc[:i]), f"override {item!r}: {_kind(node)} has no "
                                                f"key {part!r}"), "--override")
    return data


def _kind(v: Any) -> str:
    return f"the value {v!r}" if not isinstance(v, (dict, list)) else type(v).__name__


def config_from_dict(
    data: Mapping[str, Any], source: str | None = None, positions: Positions | None = None
) -> TrainConfig:
    """Validate a plain dict (as read from YAML). All problems are raised together as one ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(ConfigProblem("", f"the top level must be a mapping of keys (got {type(data).__name__})"),
                          source)
    if "stages" in data:
        raise ConfigError(ConfigProblem("stages", "this is a multi-stage config: run it with `python -m surojax.train "
                                        "--config FILE`, or read it with surojax.config.load_stages",
                                        *((positions or {}).get(("stages",)) or (None, None))), source)
    cfg, problems = validated(data, positions)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def validated(data: Mapping[str, Any], positions: Positions | None = None
              ) -> tuple[TrainConfig | None, list[ConfigProblem]]:
    """(the TrainConfig, []) or (None, every problem): Surogate's spellings read first (config/surogate.py), each
    problem at the key and line the user wrote."""
    t = translate(data, positions)
    try:
        cfg = TrainConfig.model_validate(t.data)
    except ValidationError as e:
        return None, t.problems + problems_from_validation_error(e, TrainConfig, t.positions, t.origins)
    if t.problems:
        return None, t.problems
    cfg._surogate_spellings = (*named_spellings(cfg), *t.spellings)
    cfg._surogate_notes = tuple(t.notes)
    return cfg, []


def read_config_file(path: str | os.PathLike[str]) -> tuple[Any, Positions, str]:
    """(data, key positions, source) of a YAML config file; an unreadable file is a ConfigError."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(ConfigProblem("", f"cannot read the config: {e.strerror or e}"), source) from None
    data, positions = parse_yaml(text, source)
    return data, positions, source


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> TrainConfig:
    """Read, override and validate a training YAML. Paths inside are not checked (see `check_paths`)."""
    data, positions, source = read_config_file(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(ConfigProblem("", f"the top level must be a mapping of keys (got {type(data).__name__})"),
                          source)
    overrides = list(overrides)
    if overrides:
        data = apply_overrides(data, overrides)
        # A key set by an override is no longer the one written at that line of the file.
        set_by = [parse_override(o)[0] for o in overrides]
        positions = {k: v for k, v in positions.items() if not any(k[: len(o)] == o for o in set_by)}
        positions.update((loc, None) for loc in set_by)
    return config_from_dict(data, source, positions)
