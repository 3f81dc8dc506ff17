"""`surojax merge --base-model DIR --checkpoint-dir OUT --output DIR`: fold LoRA adapters into their base
and save an HF model folder (safetensors + config.json + tokenizer) that transformers loads.

--checkpoint-dir takes a PEFT adapter folder or a training output_dir holding one in `adapter/`; repeat it
to fold several adapters in order (stacked LoRA).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from surojax.cli.common import UsageError, existing_path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-model", "--base", dest="base", required=True, metavar="DIR",
                        help="base model directory (HF safetensors) or a repo id in the local HF cache")
    parser.add_argument("--checkpoint-dir", "--adapter", dest="adapter", required=True, action="append",
                        metavar="DIR", help="PEFT adapter folder, or a training output_dir with adapter/ (repeatable)")
    parser.add_argument("--output", required=True, metavar="DIR", help="where the merged model is written")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="saved dtype (default bf16)")


def adapter_dir(path: str) -> Path:
    p = existing_path(path, "--checkpoint-dir")
    for candidate in (p, p / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise UsageError(f"--checkpoint-dir: {path} holds no adapter_config.json (nor adapter/adapter_config.json)")


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from surojax.data.hub import resolve_local
    from surojax.peft.stacked import load_adapter_into
    from surojax.weights.hf_checkpoint import load_model, save_model

    adapters = [adapter_dir(a) for a in args.adapter]
    base = Path(resolve_local(args.base))
    model = load_model(base, dtype=jnp.float32)  # fold in fp32, save in --dtype
    for a in adapters:
        load_adapter_into(model, a, trainable=False)
    tokenizer_dir = base if (base / "tokenizer.json").is_file() else adapters[-1]
    out = save_model(model, args.output, dtype=getattr(jnp, DTYPES[args.dtype]), tokenizer_dir=tokenizer_dir)
    print(f"merged {len(adapters)} adapter(s) into {base} -> {out}")
    return 0
