"""`surojax sft CONFIG` and `surojax pt CONFIG`: one command body, two stage selections.

Both validate the whole config and the paths it names before any heavy work, then train.
- `sft`: supervised fine-tuning (full, LoRA, QLoRA); every stage of the config is trained.
- `pt`: pretraining or continued pretraining on text; it trains the config's pretraining stages: a stage is
  pretraining unless its trainer is not sft or one of its datasets has a supervised type (instruction,
  conversation, preference, prompt); `type: auto` may be text, so it counts as pretraining. Of a multi-stage config
  (the quickstart: pretrain, then LoRA on instructions) the other stages are skipped with a line saying so
  (`surojax sft` runs every stage); a plain config that is not pretraining is refused, naming the key and
  `surojax sft`.
The command's name (`args.command`, set by cli/main.py's subparsers) picks the selection (`SELECT`).
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Callable

from surojax.cli.common import UsageError, add_config_arguments, add_overwrite_argument, train_from_args

if TYPE_CHECKING:
    from surojax.config import TrainConfig
    from surojax.config.stages import Stage

TEXT_TYPES = ("text", "auto")  # dataset types a pretraining run reads (auto: detected from the rows, maybe text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_overwrite_argument(parser, "what an earlier run wrote in the output_dir(s)")


def not_pretraining(cfg: TrainConfig) -> str | None:
    """Why `cfg` is not a pretraining run (the key and its value), None when it is one."""
    if cfg.trainer != "sft":
        return f"trainer: {cfg.trainer}"
    for i, d in enumerate(cfg.datasets):
        if d.type not in TEXT_TYPES:
            return f"datasets[{i}].type: {d.type}"
    return None


def pretraining_stages(stages: list[Stage], config: str) -> list[Stage]:
    """The stages `surojax pt` trains (module docstring); the others are named on stderr, or refused."""
    kept = []
    for stage in stages:
        why = not_pretraining(stage.config)
        if why is None:
            kept.append(stage)
        elif stage.index is None:
            raise UsageError(f"{config}: not a pretraining run ({why}); `surojax pt` trains on text: run "
                             f"`surojax sft {config}`")
        else:
            print(f"stage {stage.name}: skipped, not pretraining ({why}); `surojax sft {config}` runs every stage",
                  file=sys.stderr)
    if not kept:
        raise UsageError(f"{config}: no stage is pretraining (text datasets, trainer: sft); run `surojax sft {config}`")
    return kept


def all_stages(stages: list[Stage], config: str) -> list[Stage]:
    """The stages `surojax sft` trains: every one."""
    return stages


# command name -> the stages it trains, of the validated ones (the only difference between the two commands)
SELECT: dict[str, Callable[[list[Stage], str], list[Stage]]] = {"sft": all_stages, "pt": pretraining_stages}


def run(args: argparse.Namespace) -> int:
    select = SELECT[args.command]
    return train_from_args(args, select=lambda stages: select(stages, args.config))
