"""`surojax serve MODEL [--adapter DIR ...] [--host H] [--port P]`: an OpenAI-compatible HTTP server with
continuous batching. For now it checks its arguments and stops."""
from __future__ import annotations

import argparse

from surojax.cli.common import existing_path, not_implemented, positive_int


def _port(value: str) -> int:
    n = positive_int(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number <= 65535 (got {n})")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model directory or .gguf file")
    parser.add_argument("--adapter", action="append", default=[], metavar="DIR", help="PEFT adapter (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="longest prompt + completion")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences batched at once")


def run(args: argparse.Namespace) -> int:
    existing_path(args.model, "model")
    for a in args.adapter:
        existing_path(a, "--adapter")
    return not_implemented("serve")
