"""`surojax quantize --model DIR --output out.gguf --type q4_k_m`: write an HF model folder (safetensors +
config.json + tokenizer.json) as a llama.cpp GGUF file with full metadata and tokenizer.

--type takes llama.cpp's file types: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_m, q4_k_m, q5_k_m,
q6_k, iq4_nl, iq4_xs (the *_k_m mixes follow llama-quantize's per-tensor rule; see docs/quantization.md).
The fine-tune path: `surojax merge ... --output merged/`, then
`surojax quantize --model merged/ --output model.gguf --type q4_k_m`.
NF4 / FP8 / NVFP4 safetensors output is not implemented (those formats are for training: `qlora_bnb`,
`qlora_fp8`, `qlora_fp4` quantise the base at load).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from surojax.cli.common import UsageError, existing_path, not_implemented

GGUF_FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "q4_k_m",
                   "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
SAFETENSORS_FORMATS = ("nf4", "fp8", "nvfp4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="model directory (same as --model)")
    parser.add_argument("--model", metavar="DIR", help="HF model directory (safetensors + config.json + tokenizer)")
    parser.add_argument("--type", "--format", dest="type", choices=GGUF_FILE_TYPES + SAFETENSORS_FORMATS,
                        required=True, help="GGUF file type (llama.cpp's names)")
    parser.add_argument("--output", required=True, metavar="PATH", help="the .gguf file to write")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder if not the model folder")
    parser.add_argument("--name", help="general.name in the metadata (default: the model folder's name)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")


def run(args: argparse.Namespace) -> int:
    model = args.model or args.model_pos
    if model is None:
        raise UsageError("quantize: pass the model folder (--model DIR)")
    if args.model and args.model_pos and args.model != args.model_pos:
        raise UsageError("quantize: give the model folder once (MODEL or --model)")
    model_dir = existing_path(model, "--model")
    if args.type in SAFETENSORS_FORMATS:
        return not_implemented(f"quantize --type {args.type} (safetensors output; GGUF types only)")
    out = Path(args.output)
    if out.suffix.lower() != ".gguf":
        raise UsageError(f"--output {out}: expected a .gguf file name")
    if out.exists() and not args.overwrite:
        raise UsageError(f"--output {out}: exists; pass --overwrite to replace it")
    tokenizer = existing_path(args.tokenizer, "--tokenizer") if args.tokenizer else model_dir
    if not (Path(tokenizer) / "tokenizer.json").is_file():
        raise UsageError(f"{tokenizer}: no tokenizer.json (a GGUF file carries its tokenizer; pass --tokenizer DIR)")

    from surojax.weights.gguf_checkpoint import save_gguf

    path = save_gguf(model_dir, out, args.type, tokenizer_dir=tokenizer, name=args.name)
    print(f"wrote {path} ({args.type}, {path.stat().st_size / 2**20:.1f} MiB)")
    return 0
