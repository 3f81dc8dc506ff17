"""`surojax merge --base DIR --adapter DIR [--adapter DIR ...] --output DIR`: fold LoRA adapters into a base
model and save HF safetensors. For now it checks its arguments and stops."""
from __future__ import annotations

import argparse

from surojax.cli.common import existing_path, not_implemented


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, metavar="DIR", help="base model directory (HF safetensors)")
    parser.add_argument("--adapter", required=True, action="append", metavar="DIR",
                        help="PEFT adapter directory; repeat to merge several in order")
    parser.add_argument("--output", required=True, metavar="DIR", help="where the merged model is written")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="saved dtype")


def run(args: argparse.Namespace) -> int:
    existing_path(args.base, "--base")
    for a in args.adapter:
        existing_path(a, "--adapter")
    return not_implemented("merge")
