"""check_paths: the files a TrainConfig points at exist, checked on demand (never at schema time).

A name that is not a local path may be a Hugging Face repo id; it resolves only through the local HF cache
(surojax.hub, no network), and a miss says so and what to pass instead. Relative paths are relative
to the working directory.
"""
from __future__ import annotations

from pathlib import Path

from surojax.config.errors import ConfigError, ConfigProblem
from surojax.config.schema import TrainConfig
from surojax.hub import ModelNotFoundError, resolve_local


def _find(key: str, name: str, kind: str, problems: list[ConfigProblem]) -> Path | None:
    """The local file / directory for `name` (a path, or a repo id in the HF cache); else record a problem."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        return resolve_local(name, kind)
    except ModelNotFoundError as e:
        problems.append(ConfigProblem(key, str(e)))
        return None


def check_paths(cfg: TrainConfig, source: str | None = None) -> None:
    """Raise one ConfigError naming every key whose file or directory is missing."""
    problems: list[ConfigProblem] = []
    if cfg.model is not None:
        found = _find("model", cfg.model, "model", problems)
        if found is not None and found.is_dir() and not (found / "config.json").is_file():
            problems.append(ConfigProblem("model", f"{cfg.model!r} has no config.json"))
    if cfg.tokenizer is not None:
        _find("tokenizer", cfg.tokenizer, "model", problems)
    if cfg.adapter_path is not None:
        found = _find("adapter_path", cfg.adapter_path, "model", problems)
        if found is not None and found.is_dir() and not (found / "adapter_config.json").is_file():
            problems.append(ConfigProblem("adapter_path", f"{cfg.adapter_path!r} has no adapter_config.json "
                                          "(expected a PEFT adapter directory)"))
    for section in ("datasets", "validation_datasets"):
        for i, ds in enumerate(getattr(cfg, section)):
            _find(f"{section}[{i}].path", ds.path, "dataset", problems)
    if isinstance(cfg.resume_from_checkpoint, str) and not Path(cfg.resume_from_checkpoint).expanduser().exists():
        problems.append(ConfigProblem("resume_from_checkpoint", f"{cfg.resume_from_checkpoint!r} does not exist"))
    tpl = cfg.chat_template
    if tpl is not None and "{" not in tpl and "\n" not in tpl and not Path(tpl).expanduser().is_file():
        problems.append(ConfigProblem("chat_template", f"{tpl!r} is neither a file nor template text"))
    if problems:
        raise ConfigError(problems, source)
