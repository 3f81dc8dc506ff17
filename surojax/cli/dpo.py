"""`surojax dpo CONFIG`: preference optimisation (DPO) on `type: preference` datasets (LoRA, QLoRA, full).

The same as `python -m surojax.train --config CONFIG` with `trainer: dpo` implied: a config (or override) whose
`trainer` names another kind is refused. Validates the whole config and the paths it names, then trains.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from surojax.cli.common import UsageError, add_config_arguments, add_overwrite_argument, train_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_overwrite_argument(parser, "what an earlier run wrote in the output_dir(s)")


def with_trainer(args: argparse.Namespace, kind: str = "dpo") -> argparse.Namespace:
    """`args` with the override `trainer=<kind>` added, unless the config or an override already says so;
    UsageError when either names another trainer, or for a staged config (its stages name their trainers)."""
    # lazy: cli/main.py imports the subcommands for `--help`, which must not import pydantic
    from surojax.config.load import read_config_file
    from surojax.config.stages import is_staged

    data = read_config_file(args.config)[0]
    if is_staged(data):
        raise UsageError(f"surojax {kind}: {args.config} has stages; run it with `python -m surojax.train --config "
                         f"{args.config}` and `trainer: {kind}` in the stages that train with {kind}")
    said = [o.split("=", 1)[1].strip() for o in args.override if o.split("=", 1)[0].strip() == "trainer"]
    if isinstance(data, Mapping) and "trainer" in data:
        said.insert(0, str(data["trainer"]))
    other = [t for t in said if t != kind]
    if other:
        raise UsageError(f"surojax {kind}: the config says trainer: {other[-1]}; remove the key or set trainer: "
                         f"{kind} (or run `surojax {other[-1]}` / `python -m surojax.train`)")
    if said:
        return args
    return argparse.Namespace(**{**vars(args), "override": [*args.override, f"trainer={kind}"]})


def run(args: argparse.Namespace) -> int:
    return train_from_args(with_trainer(args))
