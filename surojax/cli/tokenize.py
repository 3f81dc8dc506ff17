"""`surojax tokenize CONFIG [--stage NAME|N] [--debug]`: tokenize and pack the config's datasets and report the
statistics; --debug prints a few examples token by token with the tokens that carry loss marked. A multi-stage
config needs `--stage` (a stage's name or index)."""
from __future__ import annotations

import argparse

from surojax.cli.common import UsageError, add_config_arguments, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--stage", metavar="NAME|N", default=None,
                        help="the stage of a multi-stage config (its name or its index from 0)")
    parser.add_argument("--debug", action="store_true", help="print decoded examples with trained tokens marked")
    parser.add_argument("--rows", type=positive_int, default=3, help="examples to print with --debug (default 3)")


def run(args: argparse.Namespace) -> int:
    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    from rich.console import Console

    from surojax.config.stages import load_run, select_stage
    from surojax.data.debug import debug_print
    from surojax.hub import model_path
    from surojax.data.pipeline import build_data_from_config, dataset_line
    from surojax.data.tokenizer import Tokenizer

    cfg = select_stage(load_run(args.config, args.override), args.stage, args.config).config
    source = cfg.tokenizer or cfg.model
    if source is None:
        raise UsageError("the config names no tokenizer (set `tokenizer` or `model`)")
    tokenizer = Tokenizer.from_dir(model_path(source, weights=False))
    data = build_data_from_config(cfg, tokenizer, batch_size=cfg.per_device_train_batch_size, seed=cfg.seed)
    console = Console()
    if args.debug:
        debug_print(data.examples(args.rows), tokenizer, n=args.rows, console=console)
    console.print(data.stats.summary(), highlight=False)
    for d in data.stats.datasets:
        console.print(f"  {dataset_line(d)}", highlight=False, soft_wrap=True)
    return 0
