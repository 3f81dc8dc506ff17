"""`surojax merge --base-model REF --checkpoint-dir OUT --output DIR`: fold LoRA adapters into their base
and save an HF model folder (safetensors + config.json + tokenizer) that transformers loads.

--base-model is any model reference (surojax.weights.model_ref: HF folder, .gguf file (dequantised), surojax
output folder, Hugging Face Hub id). --checkpoint-dir takes a PEFT adapter folder or a training
output_dir holding one in `adapter/`; repeat it to fold several adapters in order (stacked LoRA).
An --output folder that exists and is not empty is replaced only with --overwrite.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from surojax.cli.common import UsageError, add_overwrite_argument, existing_path, refuse_existing

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-model", "--base", dest="base", required=True, metavar="DIR",
                        help="base model: HF folder, .gguf file, surojax output folder, or a Hub id "
                             "(org/name[@revision])")
    parser.add_argument("--checkpoint-dir", "--adapter", dest="adapter", required=True, action="append",
                        metavar="DIR", help="PEFT adapter folder, or a training output_dir with adapter/ (repeatable)")
    parser.add_argument("--output", required=True, metavar="DIR", help="where the merged model is written")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="saved dtype (default bf16)")
    add_overwrite_argument(parser, "the output folder")


def adapter_dir(path: str) -> Path:
    p = existing_path(path, "--checkpoint-dir")
    for candidate in (p, p / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise UsageError(f"--checkpoint-dir: {path} holds no adapter_config.json (nor adapter/adapter_config.json)")


def run(args: argparse.Namespace) -> int:
    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    import jax.numpy as jnp

    from surojax.model_loader import load_model_ref
    from surojax.peft.stacked import load_adapter_into
    from surojax.weights.gguf_tokenizer import save_tokenizer_dir
    from surojax.weights.hf_checkpoint import save_model

    if not args.overwrite:
        refuse_existing(args.output)
    adapters = [adapter_dir(a) for a in args.adapter]
    loaded = load_model_ref(args.base, dtype=jnp.float32)  # fold in fp32, save in --dtype
    for a in adapters:
        load_adapter_into(loaded.model, a, trainable=False)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = next((d for d in (loaded.ref.tokenizer_dir, *adapters[::-1])
                              if d is not None and (d / "tokenizer.json").is_file()), None)
        if tokenizer_dir is None:  # a GGUF base: its metadata's tokenizer
            tokenizer_dir = save_tokenizer_dir(loaded.tokenizer, tmp)
        out = save_model(loaded.model, args.output, dtype=jnp.dtype(DTYPES[args.dtype]),
                         tokenizer_dir=tokenizer_dir, overwrite=args.overwrite)
    print(f"merged {len(adapters)} adapter(s) into {loaded.ref.weights} -> {out}")
    return 0
