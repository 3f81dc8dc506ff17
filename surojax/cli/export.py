"""`surojax export CONFIG [--checkpoint PATH] [--output DIR]`: write a training run's checkpoint as a PEFT
adapter (LoRA) or an HF model folder (full), exactly what the end of training writes.

The run is rebuilt from its config (model, adapters, data position) and the checkpoint restored into it:
the latest one in the run's checkpoint_dir, or the step folder given with --checkpoint.
"""
from __future__ import annotations

import argparse

from surojax.cli.common import UsageError, add_config_arguments, load_config_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--checkpoint", metavar="PATH", default=None,
                        help="a checkpoint step folder (default: the latest in the run's checkpoint_dir)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="where to write (default: <output_dir>/adapter or <output_dir>/model)")


def run(args: argparse.Namespace) -> int:
    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    from surojax.train.checkpoints import Checkpointer
    from surojax.train.trainer import Trainer

    cfg = load_config_args(args)
    target = args.checkpoint or True
    if target is True:
        ck = Checkpointer(cfg.checkpoint_dir or f"{cfg.output_dir}/checkpoints")
        if ck.latest_step() is None:
            raise UsageError(f"no checkpoint in {ck.directory}; train with save_steps first, or pass --checkpoint")
    trainer = Trainer(cfg.model_copy(update={"resume_from_checkpoint": target}))
    out = trainer.export(args.output)
    print(f"exported step {trainer.step_count} -> {out}")
    return 0
