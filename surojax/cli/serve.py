"""`surojax serve MODEL [--port P] [--api-key K] [--enable-lora --lora-modules NAME=PATH ...]`: an
OpenAI-compatible HTTP server with continuous batching, paged KV cache, prefix caching, streaming and runtime
LoRA (docs/serving.md). scripts/serve.py is the same entry point. Nothing heavy is imported until `run`."""
from __future__ import annotations

import argparse

HELP = "serve a model over an OpenAI-compatible HTTP API"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="HF model folder, surojax output folder, or .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as 'model'")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--attention", default="xla", help="attention backend (xla, cudnn, auto)")
    parser.add_argument("--max-model-len", type=_positive, default=None,
                        help="longest prompt + completion (default: the model's, at most 8192)")
    parser.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences batched at once")
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=8192,
                        help="tokens per engine step (prompt tokens prefilled with the running decodes)")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond max-num-seqs (then 429)")
    parser.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block")
    parser.add_argument("--decode-steps", type=_power_of_two, default=1,
                        help="decode tokens per device call when no request waits (1, 2, 4, 8, ...)")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="inline the layer loop (faster decode, longer compiles; same results)")
    parser.add_argument("--kv-path", choices=("auto", "paged", "reduce", "pallas", "reference"), default="auto",
                        help="decode KV access: auto (pallas on a GPU where it applies, else paged), "
                             "paged (attention reads the pool in place through block tables), "
                             "reduce / pallas (the same, decode attention as multiply + reduce / in a Pallas "
                             "kernel), reference (gather/scatter)")
    parser.add_argument("--num-kv-blocks", type=_positive, default=None,
                        help="KV blocks (default: from free device memory; a fixed size on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters picked per request")
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH", help="PEFT adapters to load")
    parser.add_argument("--max-loras", type=_positive, default=4, help="adapter slots")
    parser.add_argument("--max-lora-rank", type=_positive, default=64)
    parser.add_argument("--log-level", default="info")


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value!r})") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {n})")
    return n


def _power_of_two(value: str) -> int:
    n = _positive(value)
    if n & (n - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two (got {n})")
    return n


def _port(value: str) -> int:
    n = _positive(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number <= 65535 (got {n})")
    return n


def run(args: argparse.Namespace) -> int:
    from surojax.serve.launch import serve

    return serve(args)
