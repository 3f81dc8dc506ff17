"""ConfigError: the one exception every config problem becomes, with a short human-readable str.

Each problem names the YAML key it is about (`datasets[0].type`), and where known the file and line, so
that a CLI can print it as one line with no traceback. Several problems are reported together.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config. `key` is a path like `datasets[0].path` ('' for the whole file)."""

    key: str
    message: str
    line: int | None = None  # 1-based line in `source`, where known
    column: int | None = None  # 1-based

    def render(self, source: str | None) -> str:
        where = source or "config"
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(ValueError):
    """A config that cannot be used. str() is one line per problem, nothing else."""

    is_user_error = True  # the CLI prints it cleanly and exits 1

    def __init__(self, problems: list[ConfigProblem] | ConfigProblem | str, source: str | None = None):
        if isinstance(problems, str):
            problems = [ConfigProblem("", problems)]
        elif isinstance(problems, ConfigProblem):
            problems = [problems]
        self.problems: list[ConfigProblem] = list(problems)
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(p.render(self.source) for p in self.problems)

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.problems]


def format_key(loc: tuple[str | int, ...] | list[str | int]) -> str:
    """('datasets', 0, 'path') -> 'datasets[0].path'."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        else:
            out += f".{item}" if out else str(item)
    return out
