"""`surojax export CONFIG [--stage NAME|N] [--checkpoint PATH] [--output DIR] [--overwrite]`: write a training
run's checkpoint as a PEFT adapter (LoRA) or an HF model folder (full), exactly what the end of training writes.

The run is rebuilt from its config (model, adapters, data position) and the checkpoint restored into it:
the latest one in the run's checkpoint_dir, or the step folder given with --checkpoint. A multi-stage config
needs `--stage` (a stage's name or index). An output folder that exists and is not empty (by default the run's
own final export, <output_dir>/adapter or /model) is never replaced without --overwrite.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from surojax.cli.common import UsageError, add_config_arguments, add_overwrite_argument, refuse_existing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--stage", metavar="NAME|N", default=None,
                        help="the stage of a multi-stage config to export (its name or its index from 0)")
    parser.add_argument("--checkpoint", metavar="PATH", default=None,
                        help="a checkpoint step folder (default: the latest in the run's checkpoint_dir)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="where to write (default: <output_dir>/adapter or <output_dir>/model)")
    add_overwrite_argument(parser, "the output folder")


def run(args: argparse.Namespace) -> int:
    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    from surojax.config.stages import load_run, select_stage
    from surojax.train.checkpoints import Checkpointer
    from surojax.train.trainers import make_trainer

    cfg = select_stage(load_run(args.config, args.override), args.stage, args.config).config
    output = Path(args.output) if args.output else Path(cfg.output_dir) / ("adapter" if cfg.lora else "model")
    if not args.overwrite:
        refuse_existing(output)
        if cfg.lora and cfg.merge_adapter:
            refuse_existing(Path(cfg.output_dir) / "merged", "merge_adapter's folder")
    target = args.checkpoint or True
    if target is True:
        ck = Checkpointer(cfg.checkpoint_dir or f"{cfg.output_dir}/checkpoints")
        for p in ck.removed_unfinished:
            print(f"{p}: an unfinished checkpoint (its save was cut off); removed", file=sys.stderr)
        latest = ck.latest_step()
        ck.close()
        if latest is None:
            raise UsageError(f"no checkpoint in {ck.directory}; train with save_steps first, or pass --checkpoint")
    trainer = make_trainer(cfg.model_copy(update={"resume_from_checkpoint": target}))
    try:
        out = trainer.export(output, overwrite=args.overwrite)
    finally:
        trainer.close()
    print(f"exported step {trainer.step_count} -> {out}")
    return 0
