"""`python -m surojax.train --config FILE [--override key=value ...]` (entry in surojax/train/__main__.py).

Validates the whole config (and the paths it names) before any heavy work, then trains. A config with a
`stages:` list (e.g. configs/quickstart.yaml) runs its stages in order, every stage validated first.
"""
from __future__ import annotations

import argparse

from surojax.cli.common import add_config_arguments, add_overwrite_argument, run_guarded, train_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m surojax.train", description="Train from a YAML config.")
    add_config_arguments(parser, flag=True)
    add_overwrite_argument(parser, "what an earlier run wrote in the output_dir(s)")
    return parser


def _run(args: argparse.Namespace) -> int:
    return train_from_args(args, config_flag=True)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return run_guarded(_run, args)
