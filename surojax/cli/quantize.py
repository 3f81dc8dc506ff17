"""`surojax quantize --model REF --output out.gguf --type q4_k_m`: write a model as a llama.cpp GGUF file with full
metadata and tokenizer. REF is any model reference (surojax.weights.model_ref): an HF folder, a training run's
output folder, a PEFT adapter folder (folded into its base first), a .gguf file (re-quantised from its
dequantised values) or a Hugging Face Hub id.

--type takes llama.cpp's file types: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_m, q4_k_m, q5_k_m,
q6_k, iq4_nl, iq4_xs (the *_k_m mixes follow llama-quantize's per-tensor rule; see docs/quantization.md).
The fine-tune path: `surojax quantize --model runs/NAME --output model.gguf --type q4_k_m` (or `surojax merge` first
to keep the merged HF folder).
There is no NF4 / FP8 / NVFP4 file output: those formats are for training (`qlora_bnb`, `qlora_fp8`,
`qlora_fp4` quantise the base at load).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from surojax.cli.common import UsageError, add_overwrite_argument, existing_path, refuse_existing

GGUF_FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "q4_k_m",
                   "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="the model (same as --model)")
    parser.add_argument("--model", metavar="REF", help="HF model folder, surojax output folder, PEFT adapter folder, "
                                                       ".gguf file, or a Hub id (org/name[@revision])")
    parser.add_argument("--type", "--format", dest="type", choices=GGUF_FILE_TYPES,
                        required=True, help="GGUF file type (llama.cpp's names)")
    parser.add_argument("--output", required=True, metavar="PATH", help="the .gguf file to write")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder if not the model folder")
    parser.add_argument("--name", help="general.name in the metadata (default: the model folder's or file's name)")
    add_overwrite_argument(parser, "the output file")


def run(args: argparse.Namespace) -> int:
    model = args.model or args.model_pos
    if model is None:
        raise UsageError("quantize: pass the model (--model REF)")
    if args.model and args.model_pos and args.model != args.model_pos:
        raise UsageError("quantize: give the model once (MODEL or --model)")
    out = Path(args.output)
    if out.suffix.lower() != ".gguf":
        raise UsageError(f"--output {out}: expected a .gguf file name")
    if not args.overwrite:
        refuse_existing(out)
    tokenizer = existing_path(args.tokenizer, "--tokenizer") if args.tokenizer else None
    if tokenizer is not None and not (tokenizer / "tokenizer.json").is_file():
        raise UsageError(f"--tokenizer {tokenizer}: no tokenizer.json")

    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    import jax.numpy as jnp

    from surojax.model_loader import load_model_ref
    from surojax.weights.gguf_checkpoint import save_gguf
    from surojax.weights.gguf_tokenizer import save_tokenizer_dir
    from surojax.weights.model_ref import hf_config_of, resolve_model

    ref = resolve_model(model)
    hf = hf_config_of(ref)
    # A bf16 checkpoint loads losslessly as bf16 (half the memory); an adapter is folded in fp32.
    stored_bf16 = ref.kind == "hf" and ref.adapter is None and (hf.get("torch_dtype") or hf.get("dtype")) == "bfloat16"
    loaded = load_model_ref(ref, dtype=jnp.float32, param_dtype=jnp.bfloat16 if stored_bf16 else jnp.float32,
                            tokenizer_dir=tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = tokenizer or ref.tokenizer_dir or save_tokenizer_dir(loaded.tokenizer, tmp)  # GGUF: metadata's
        path = save_gguf(loaded.model, out, args.type, tokenizer_dir=tokenizer_dir,
                        name=args.name or ref.name.split("/")[-1])
    print(f"wrote {path} ({args.type}, {path.stat().st_size / 2**20:.1f} MiB)")
    return 0
