"""`surojax distill CONFIG`: knowledge distillation of the run's `model` (the student) from a `teacher`.

    surojax distill CONFIG                 # trainer: distill (implied); the teacher runs online, frozen
    surojax distill CONFIG --precompute    # write the teacher's top-K log-probs of the tokenized data (the sidecar)
    surojax distill CONFIG -o teacher_logprobs=OUT/teacher_logprobs    # train from the sidecar: no teacher loaded

The config's `trainer` may be left out or be `distill`; any other value is refused. --precompute writes to the
config's `teacher_logprobs`, else to <output_dir>/teacher_logprobs (surojax/train/teacher_sidecar.py: the layout).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from surojax.cli.common import (
    UsageError, add_config_arguments, add_overwrite_argument, command_setting, launcher, load_config_args,
    refuse_existing, train_from_args)

TRAINER = "distill"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_overwrite_argument(parser, "what an earlier run (or --precompute) wrote")
    parser.add_argument("--precompute", action="store_true",
                        help="run the teacher over the tokenized training and validation data and write its top-K "
                             "log-probs (the sidecar), then stop")
    parser.add_argument("--logprobs-dtype", choices=("float16", "float32"), default=None,
                        help="with --precompute: how the sidecar stores log-probs (default float16; ids are int32)")


def trainer_override(config: str, overrides: list[str]) -> list[str]:
    """`overrides` + trainer=distill; UsageError when the YAML or an override sets another trainer."""
    from surojax.config.load import parse_yaml  # lazy: `surojax --help` must not import pydantic

    data, _ = parse_yaml(Path(config).read_text(encoding="utf-8"), config)
    written = [data.get("trainer")] if isinstance(data, dict) and "trainer" in data else []
    written += [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "trainer"]
    for value in written:
        if value != TRAINER:
            raise UsageError(f"trainer: {value} in {config} (or its overrides); `surojax distill` runs trainer: "
                             f"{TRAINER} (leave the key out, or run `surojax sft` for an SFT config)")
    return [*overrides, f"trainer={TRAINER}"]


def train_command(config: str, overrides: list[str], sidecar: str | Path) -> str:
    """The shell command that trains from a precomputed sidecar: the same config and the user's own overrides
    (their teacher_logprobs replaced), runnable from the user's shell (cli/common.py `launcher`)."""
    return command_setting(launcher("distill")[0], config, overrides, "teacher_logprobs", sidecar)


def precompute(args: argparse.Namespace, user_overrides: list[str]) -> int:
    from surojax.train.distill import precompute_teacher_logprobs, sidecar_path  # lazy: imports jax

    cfg = load_config_args(args)
    out = sidecar_path(cfg)
    if not args.overwrite:
        refuse_existing(out, "teacher_logprobs")
    written = precompute_teacher_logprobs(cfg, out, dtype=args.logprobs_dtype or "float16")
    print(f"teacher top-{cfg.teacher_top_k} log-probs: {written}\n"
          f"train from it with: {train_command(args.config, user_overrides, written)}")
    return 0


def run(args: argparse.Namespace) -> int:
    user_overrides = list(args.override)
    args.override = trainer_override(args.config, args.override)
    if args.precompute:
        return precompute(args, user_overrides)
    if args.logprobs_dtype is not None:
        raise UsageError("--logprobs-dtype: only applies with --precompute")
    return train_from_args(args)
