"""`surojax bench CONFIG [--steps N]`: time training steps of a config (tokens/s, MFU, peak memory) on
synthetic batches. For now it validates the config and stops."""
from __future__ import annotations

import argparse

from surojax.cli.common import add_config_arguments, load_config_args, not_implemented, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed steps first, incl. compile")


def run(args: argparse.Namespace) -> int:
    load_config_args(args, check_paths=False)  # synthetic batches: the datasets need not exist
    return not_implemented("bench")
