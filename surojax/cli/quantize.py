"""`surojax quantize MODEL --format FORMAT --output PATH`: quantize a model's linear weights (NF4, FP8,
NVFP4 safetensors, or a GGUF file). For now it checks its arguments and stops."""
from __future__ import annotations

import argparse

from surojax.cli.common import existing_path, not_implemented

FORMATS = ("nf4", "fp8", "nvfp4", "q4_0", "q4_k", "q5_k", "q6_k", "q8_0", "iq4_xs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model directory (HF safetensors + config.json)")
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--output", required=True, metavar="PATH")
    parser.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                        help="keep weights whose name matches this regex unquantized (repeatable)")


def run(args: argparse.Namespace) -> int:
    existing_path(args.model, "model")
    return not_implemented("quantize")
