"""Validated training config: the YAML users write (Surogate / Axolotl key names), checked before any work.

    from surojax.config import load_config, check_paths, ConfigError
    cfg = load_config("train.yaml", overrides=["learning_rate=1e-4"])   # raises ConfigError
    check_paths(cfg)                                                       # raises ConfigError

Files: base (strict model), one section per concept (run, data, precision, lora, optim, memory, parallel),
schema (TrainConfig = all sections), rules (all cross-field checks), explain (pydantic errors -> short
problems), load (YAML + overrides), paths (existence checks; Hub ids via surojax.hub), summary (console lines),
stages (multi-stage YAML: `load_run` / `load_stages` validate every stage up front), surogate (Surogate's
spellings read at load), surogate_defaults (its defaults that differ, for the start-up summary), grpo_colocate
(Surogate's three GRPO files as one config).
"""
from surojax.config.data import DatasetSpec
from surojax.config.errors import ConfigError, ConfigProblem
from surojax.config.load import apply_overrides, config_from_dict, load_config, parse_override
from surojax.config.lora import LORA_TARGETS
from surojax.config.parallel import MESH_AXES, ParallelConfig
from surojax.config.paths import check_paths
from surojax.config.schema import TrainConfig
from surojax.config.stages import Stage, load_run, load_stages
from surojax.config.summary import summarize

__all__ = [
    "LORA_TARGETS", "MESH_AXES", "ConfigError", "ConfigProblem", "DatasetSpec", "ParallelConfig", "Stage",
    "TrainConfig", "apply_overrides", "check_paths", "config_from_dict", "load_config", "load_run", "load_stages",
    "parse_override", "summarize",
]
