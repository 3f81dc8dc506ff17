"""check_paths: the files a TrainConfig points at exist, checked on demand (never at schema time).

A name that is not a local path may be a Hugging Face Hub id (surojax.hub). Checking one is cheap and fails fast:
a model's head files (config, tokenizer, adapter config: a few KB, no weights) are fetched into the HF cache, a
dataset's metadata and file list are read (its subset and split checked, no data downloaded). A bad id, a missing
revision / subset / split, a gated repo or no network (offline: not in the cache) is a problem naming the key,
the id and the reason. Relative paths are relative to the working directory.
"""
from __future__ import annotations

from pathlib import Path

from surojax.config.data import DatasetSpec
from surojax.config.errors import ConfigError, ConfigProblem
from surojax.config.schema import TrainConfig
from surojax.hub import HubError, check_dataset, gguf_files, model_path, parse_hub_id


def _find(key: str, name: str, problems: list[ConfigProblem]) -> Path | None:
    """The local file / directory for a model-like `name` (a path, or a Hub id's head files; None for a Hub GGUF
    id, whose file is only looked up in the repo's listing here); else record a problem."""
    hub_id = None if Path(name).expanduser().exists() else parse_hub_id(name)
    try:
        if hub_id is not None and hub_id.quant is not None:
            gguf_files(name)
            return None
        return model_path(name, weights=False)
    except HubError as e:
        problems.append(ConfigProblem(key, str(e)))
        return None


def dataset_problem(spec: DatasetSpec) -> str | None:
    """None when the dataset `spec` names is a local path, or a Hub dataset with its subset and split; else why
    not."""
    if Path(spec.path).expanduser().exists():
        return None
    try:
        check_dataset(spec.path, subset=spec.subset, split=spec.split, data_files=spec.data_files)
    except HubError as e:
        return str(e)
    return None


def check_paths(cfg: TrainConfig, source: str | None = None) -> None:
    """Raise one ConfigError naming every key whose file, directory or Hub repo is missing."""
    problems: list[ConfigProblem] = []
    if cfg.model is not None:
        found = _find("model", cfg.model, problems)
        if found is not None and found.is_dir() and not (found / "config.json").is_file():
            problems.append(ConfigProblem("model", f"{cfg.model!r} has no config.json"))
    if cfg.tokenizer is not None:
        _find("tokenizer", cfg.tokenizer, problems)
    if cfg.teacher is not None:
        _find("teacher", cfg.teacher, problems)
    if cfg.adapter_path is not None:
        found = _find("adapter_path", cfg.adapter_path, problems)
        if found is not None and found.is_dir() and not (found / "adapter_config.json").is_file():
            problems.append(ConfigProblem("adapter_path", f"{cfg.adapter_path!r} has no adapter_config.json "
                                          "(expected a PEFT adapter directory)"))
    for section in ("datasets", "validation_datasets"):
        for i, ds in enumerate(getattr(cfg, section)):
            why = dataset_problem(ds)
            if why is not None:
                problems.append(ConfigProblem(f"{section}[{i}].path", why))
    if isinstance(cfg.resume_from_checkpoint, str) and not Path(cfg.resume_from_checkpoint).expanduser().exists():
        problems.append(ConfigProblem("resume_from_checkpoint", f"{cfg.resume_from_checkpoint!r} does not exist"))
    tpl = cfg.chat_template
    if tpl is not None and "{" not in tpl and "\n" not in tpl and not Path(tpl).expanduser().is_file():
        problems.append(ConfigProblem("chat_template", f"{tpl!r} is neither a file nor template text"))
    if problems:
        raise ConfigError(problems, source)
