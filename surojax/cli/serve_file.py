"""`surojax serve FILE.yaml`: several models in one server, read from a serve config YAML -> `MultiServeConfig`.

    host: 0.0.0.0                # server keys: host, port, api_key, max_request_bytes, log_level,
    port: 8000                   #   enable_sleep_mode (POST /sleep, /wake_up, GET /is_sleeping; idle sleep)
    enable_sleep_mode: true
    models:                      # one entry per model; the first is the default (requests without "model")
      - model: Qwen/Qwen3-0.6B   # any MODEL `surojax serve` takes: folder, .gguf file, Hub id
        served_model_name: small
        gpu_memory_utilization: 0.3
        max_model_len: 4096
        enable_lora: true
        lora_modules: {sql: ./adapters/sql}
      - model: ./big.gguf
        served_model_name: big
        num_kv_blocks: 2048
        sleep_after_idle_s: 600

A model entry takes the options of `surojax serve MODEL` under their option names (`--max-num-seqs` is
`max_num_seqs`; `enable_prefix_caching: false` is `--no-prefix-caching`; `lora_modules` a mapping NAME: PATH),
with the CLI's defaults and rules (`cli.serve.serve_config`), plus `sleep_after_idle_s`. Its KV budget:
`gpu_memory_utilization` is its share of the device's memory (weights and KV pool; the models loaded before it
do not count against it), or `num_kv_blocks` / `kv_capacity` sizes its pool outright. Shares must sum to at
most 1; a model that gives no budget gets an equal part of what the others' shares leave of 0.9. Everything
is checked before any weights load: unknown keys (by name, with the closest valid one), bad values, duplicate
model / adapter names, shares over the device; problems carry the file, key and line.
"""
from __future__ import annotations

import argparse
from typing import Callable
from typing import Literal

from pydantic import Field, ValidationError

from surojax.config.base import StrictModel
from surojax.config.errors import ConfigError, ConfigProblem
from surojax.config.explain import problems_from_validation_error
from surojax.config.load import read_config_file
from surojax.serve.config import EngineConfig, KVCacheDtype, KVPath, MultiServeConfig, ServeConfig, ServedModel

DEFAULT_MEMORY = EngineConfig().memory_utilization  # what the models that give no budget share
_SERVE = ServeConfig(model="")

class ModelEntry(StrictModel):
    """One model: the `surojax serve MODEL` options by name (None: the CLI's default)."""

    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16"] | None = None
    attention: str | None = None
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    max_queue: int | None = Field(None, ge=0)
    block_size: int | None = Field(None, gt=0)
    decode_steps: int | Literal["auto"] | None = None
    unroll_layers: bool | None = None
    kv_path: Literal[tuple(p.value for p in KVPath)] | None = None  # type: ignore[valid-type]
    kv_cache_dtype: Literal[tuple(d.value for d in KVCacheDtype)] | None = None  # type: ignore[valid-type]
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    num_kv_blocks: int | None = Field(None, gt=0)
    kv_capacity: int | Literal["auto"] | None = None
    enable_prefix_caching: bool | None = None
    enable_lora: bool | None = None
    lora_modules: dict[str, str] | None = None
    max_loras: int | None = Field(None, gt=0)
    max_lora_rank: int | None = Field(None, gt=0)
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = Field(None, gt=0)
    speculative_disable_by_batch_size: int | None = Field(None, gt=0)
    sleep_after_idle_s: float | None = Field(None, gt=0)


class ServeFile(StrictModel):
    """The file: server keys and the models."""

    host: str = _SERVE.host
    port: int = Field(_SERVE.port, gt=0, le=65535)
    api_key: str | None = None
    max_request_bytes: int = Field(_SERVE.max_request_bytes, gt=0)
    log_level: str = _SERVE.log_level
    enable_sleep_mode: bool = False
    models: list[ModelEntry] = Field(min_length=1)


Options = Callable[[str], argparse.Namespace]  # MODEL -> `surojax serve MODEL`'s options, all at their defaults
ToConfig = Callable[[argparse.Namespace], ServeConfig]  # the options -> ServeConfig (`cli.serve.serve_config`)


class ServeFileError(ValueError):
    is_user_error = True


def _budgets(entries: list[ModelEntry]) -> tuple[list[float | None], list[ConfigProblem]]:
    """Each model's share of the device (None: its pool is sized by num_kv_blocks / kv_capacity)."""
    problems = []
    given = [e.gpu_memory_utilization for e in entries]
    sized = [e.num_kv_blocks is not None or e.kv_capacity not in (None, "auto") for e in entries]
    for i, (share, fixed) in enumerate(zip(given, sized)):
        if share is not None and fixed:
            problems.append(ConfigProblem(f"models[{i}].gpu_memory_utilization", "give one KV budget: "
                                          "gpu_memory_utilization, or num_kv_blocks / kv_capacity"))
    total = sum(s for s in given if s is not None)
    if total > 1:
        problems.append(ConfigProblem("models", f"the models' gpu_memory_utilization shares sum to {total:g}, more "
                                      "than the device's memory (1): lower them"))
    open_ = [i for i, (s, f) in enumerate(zip(given, sized)) if s is None and not f]
    left = DEFAULT_MEMORY - total
    if open_ and left <= 0:
        problems.append(ConfigProblem("models", f"the gpu_memory_utilization shares given sum to {total:g}, which "
                                      f"leaves nothing of {DEFAULT_MEMORY:g} for the {len(open_)} model(s) without "
                                      "a budget: give them gpu_memory_utilization or num_kv_blocks"))
    shares = [s if s is not None else (None if f else left / len(open_)) for s, f in zip(given, sized)]
    return shares, problems


def _served(entry: ModelEntry, share: float | None, several: bool, options: Options, to_config: ToConfig
            ) -> ServedModel:
    args = options(entry.model)
    values = entry.model_dump(exclude_none=True, exclude={"model", "sleep_after_idle_s", "lora_modules",
                                                          "enable_prefix_caching", "gpu_memory_utilization"})
    for key, value in values.items():
        if not hasattr(args, key):  # a schema key the CLI does not have would be read by nothing
            raise AssertionError(f"serve file key {key!r} is not an option of `surojax serve`")
        setattr(args, key, value)
    if entry.lora_modules is not None:
        args.lora_modules = [f"{name}={path}" for name, path in entry.lora_modules.items()]
    if entry.enable_prefix_caching is not None:
        args.no_prefix_caching = not entry.enable_prefix_caching
    if share is not None:
        args.gpu_memory_utilization = share
    if several and entry.served_model_name is None:
        raise ServeFileError("served_model_name is required when several models are served (the name clients "
                               "pass as model)")
    return ServedModel(to_config(args), entry.sleep_after_idle_s)


def read_serve_file(path: str, options: Options, to_config: ToConfig) -> MultiServeConfig:
    """The YAML at `path` -> `MultiServeConfig`; every problem is one ConfigError (file, key, line). options /
    to_config: the CLI's (`cli.serve`), so that a model entry has the defaults and rules of its options."""
    data, positions, source = read_config_file(path)
    try:
        file = ServeFile.model_validate(data if data is not None else {})
    except ValidationError as e:
        raise ConfigError(problems_from_validation_error(e, ServeFile, positions), source) from None
    shares, problems = _budgets(file.models)
    models = []
    for i, (entry, share) in enumerate(zip(file.models, shares)):
        try:
            models.append(_served(entry, share, len(file.models) > 1, options, to_config))
        except ValueError as e:  # the CLI's ServeOptionError, the configs' own checks
            line = positions.get(("models", i, "model")) or (None, None)
            problems.append(ConfigProblem(f"models[{i}]", str(e), *line))
    if problems:
        raise ConfigError(problems, source)
    try:
        return MultiServeConfig(tuple(models), host=file.host, port=file.port, api_key=file.api_key,
                                max_request_bytes=file.max_request_bytes, log_level=file.log_level,
                                enable_sleep_mode=file.enable_sleep_mode)
    except ValueError as e:
        raise ConfigError(ConfigProblem("models", str(e)), source) from None


def check_no_options(args: argparse.Namespace, options: Options) -> None:
    """`surojax serve FILE.yaml` takes every setting from the file: an option given beside it is refused."""
    defaults = vars(options(args.model))
    given = [k for k, v in vars(args).items() if k in defaults and k != "model" and v != defaults[k]]
    if given:
        raise ServeFileError(f"{args.model} is a serve config file: put {', '.join(sorted(given))} in it (options "
                               "beside a config file are not read)")


__all__ = ["ModelEntry", "ServeFile", "ServeFileError", "check_no_options", "read_serve_file"]
