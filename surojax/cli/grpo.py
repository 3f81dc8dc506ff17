"""`surojax grpo CONFIG`: reinforcement learning with GRPO.

For now it validates the config and the paths it points at, prints what it would do, and stops.
"""
from __future__ import annotations

import argparse

from surojax.cli.common import add_config_arguments, load_config_args, not_implemented, print_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    print_summary(load_config_args(args))
    return not_implemented("grpo")
