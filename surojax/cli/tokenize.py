"""`surojax tokenize CONFIG [--debug]`: tokenize and pack the config's datasets; --debug prints rows with
their loss masks. For now it validates the config and stops."""
from __future__ import annotations

import argparse

from surojax.cli.common import add_config_arguments, load_config_args, not_implemented, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="print decoded rows with trained tokens marked")
    parser.add_argument("--rows", type=positive_int, default=3, help="rows to print with --debug (default 3)")


def run(args: argparse.Namespace) -> int:
    load_config_args(args)
    return not_implemented("tokenize")
