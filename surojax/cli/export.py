"""`surojax export CHECKPOINT --format hf|peft|gguf --output PATH`: write a training checkpoint in an
interoperable format. For now it checks its arguments and stops."""
from __future__ import annotations

import argparse

from surojax.cli.common import UsageError, existing_path, not_implemented

GGUF_OUT_TYPES = ("f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory written by training")
    parser.add_argument("--format", choices=["hf", "peft", "gguf"], default="hf",
                        help="hf: safetensors + config.json; peft: the LoRA adapter; gguf: for llama.cpp")
    parser.add_argument("--gguf-type", choices=GGUF_OUT_TYPES, default=None, help="GGUF tensor type (gguf only)")
    parser.add_argument("--output", required=True, metavar="PATH")


def run(args: argparse.Namespace) -> int:
    existing_path(args.checkpoint, "checkpoint")
    if args.gguf_type is not None and args.format != "gguf":
        raise UsageError("--gguf-type only applies with --format gguf")
    return not_implemented("export")
