"""`surojax sft CONFIG`: supervised fine-tuning (full, LoRA, QLoRA).

Validates the whole config and the paths it names before any heavy work, then trains.
"""
from __future__ import annotations

import argparse

from surojax.cli.common import add_config_arguments, add_overwrite_argument, train_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_overwrite_argument(parser, "what an earlier run wrote in the output_dir(s)")


def run(args: argparse.Namespace) -> int:
    return train_from_args(args)
