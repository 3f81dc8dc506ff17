"""`surojax grpo CONFIG`: reinforcement learning with GRPO (`trainer: grpo`, surojax/train/grpo.py).

The same run as `python -m surojax.train --config CONFIG` with `trainer: grpo` implied: a config that leaves
`trainer` out is a GRPO run, one that names another trainer is refused. Validates the whole config and the paths it
names before any heavy work, then trains (rollouts on the co-located serving engine, rewards, the policy loss).
"""
from __future__ import annotations

import argparse
import sys

from surojax.cli.common import add_config_arguments, add_overwrite_argument, train_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_overwrite_argument(parser, "what an earlier run wrote in the output_dir(s)")


def written_trainer(config: str, overrides: list[str]) -> str | None:
    """The `trainer` the config file (or a `-o trainer=...` override) names, None when it names none."""
    # lazy: cli/main.py imports this module for `--help`, which must not import pydantic or jax
    from surojax.config.load import parse_override, read_config_file

    value = None
    data = read_config_file(config)[0]
    if isinstance(data, dict) and "trainer" in data:
        value = data["trainer"]
    for o in overrides:
        key, v = parse_override(o)[:2]
        if key == ("trainer",):
            value = v
    return None if value is None else str(value)


def run(args: argparse.Namespace) -> int:
    trainer = written_trainer(args.config, args.override)
    if trainer not in (None, "grpo"):
        print(f"error: {args.config}: trainer: {trainer} is not a GRPO run; `surojax grpo` runs trainer: grpo (remove "
              f"the key or run `python -m surojax.train --config {args.config}`)", file=sys.stderr)
        return 2
    if trainer is None:
        args.override = [*args.override, "trainer=grpo"]
    return train_from_args(args)
