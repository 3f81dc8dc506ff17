"""`surojax generate --model REF --prompt TEXT [--chat] ...`: print a completion (a plain KV cache).

REF is anything surojax.weights.model_ref resolves: an HF folder, a .gguf file, a training run's output folder,
a PEFT adapter folder (folded into the base its adapter_config.json names) or a Hugging Face Hub id
(org/name[@revision], org/name:QUANT for a GGUF repo; fetched into the HF cache, see surojax.hub).

The options are checked before the model loads, every bad one with its own line (the flag, its value, what it
accepts). `--system` is a message of the chat template, so it needs `--chat` (without it the prompt is plain text
and a system message has no place: refused, not ignored and not implied). `--image PATH` (repeatable, with --chat)
puts images before the prompt in the user message, parsed as the server parses a chat request's image parts
(serve/image_prompt.py); the vision tower runs in the prefill and the positions are M-RoPE's
(generation/loop.py's `generate` with pixel_values / image_grid_thw).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from surojax.cli.common import UsageError
from surojax.generation.context import completion_budget


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="HF model folder, .gguf file, surojax output folder (model/ or adapter/), PEFT adapter "
                        "folder, or a Hub id (org/name[@revision], org/name:QUANT)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: the model's)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message of the chat template (needs --chat)")
    p.add_argument("--image", dest="images", action="append", default=[], metavar="PATH",
                   help="an image before the prompt in the user message (repeatable, needs --chat and a Qwen3-VL / "
                        "Qwen3.5 vision-language model)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at least 1 (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off (default)")
    p.add_argument("--top-k", type=int, default=0, help="the k most likely tokens; 0 (default) or -1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--show-ids", action="store_true", help="also print the generated token ids")


def option_problems(args: argparse.Namespace) -> list[str]:
    """One line per unusable option: the flag, the value given and what it accepts."""
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        problems.append(f"--temperature {args.temperature:g}: must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p {args.top_p:g}: must be in (0, 1] (1 = off)")
    if args.top_k < -1:
        problems.append(f"--top-k {args.top_k}: must be -1 or 0 (off) or positive")
    if args.system is not None and not args.chat:
        problems.append("--system: a system message goes through the chat template; add --chat (without it the "
                        "prompt is encoded as plain text)")
    if args.images and not args.chat:
        problems.append("--image: images go into the chat template's user message; add --chat")
    for path in args.images:
        if not Path(path).expanduser().is_file():
            problems.append(f"--image {path}: no such file")
    return problems


def image_prompt(args: argparse.Namespace, tokenizer, model_dir):
    """The `--image` prompt: the user message (images, then --prompt) after --system, as serve/image_prompt.py
    builds a chat request's (ImagePrompt: ids, pixel_values, image_grid_thw, rope_positions ...)."""
    from surojax.data.sources import DataError
    from surojax.data.vision_data import TextOnly, model_vision
    from surojax.serve.image_prompt import ImagePromptError, image_messages, prompt_with_images

    try:
        vision = model_vision(model_dir) if model_dir is not None else TextOnly(f"{args.model} has no model folder")
        return prompt_with_images(image_messages(args.prompt, args.images, system=args.system), tokenizer, vision)
    except (DataError, ImagePromptError) as e:
        raise UsageError(f"--image: {e}") from None


def run(args: argparse.Namespace) -> int:
    problems = option_problems(args)
    if problems:
        raise UsageError("\n".join(problems))
    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    import jax.numpy as jnp

    from surojax.model_loader import load_model_ref
    from surojax.generation.loop import eos_ids, generate
    from surojax.quant.laid_out import decode_weights

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    t0 = time.perf_counter()
    # a GGUF file stays quantised (its weights packed on the device, not a bf16 copy), and the weights that the
    # fused decode GEMV takes are laid out for it once, as `surojax serve` does (docs/quant_kernels.md, "Decode")
    loaded = load_model_ref(args.model, dtype=dtype, tokenizer_dir=args.tokenizer, keep_quantized=True)
    model, tokenizer = loaded.model, loaded.tokenizer
    decode_weights(model)
    images = {}
    if args.images:
        prompt = image_prompt(args, tokenizer, loaded.ref.model_dir)  # a text model: refused by name
        if getattr(model, "visual", None) is None:
            raise UsageError(f"--image: {args.model} has no vision tower (no model.visual.* tensors): it takes no "
                             "images")
        ids = prompt.ids
        images = dict(pixel_values=[prompt.pixel_values], image_grid_thw=[prompt.image_grid_thw])
    elif args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        ids = tokenizer.encode(args.prompt)
    if not ids:
        raise SystemExit("the prompt encodes to no tokens")
    context = model.cfg.max_position_embeddings
    max_new_tokens = completion_budget(len(ids), args.max_new_tokens, context)  # the rule `serve` applies
    if max_new_tokens < args.max_new_tokens:
        print(f"[--max-new-tokens {args.max_new_tokens} cut to {max_new_tokens}: the prompt has {len(ids)} tokens "
              f"and the model's context is {context}]", file=sys.stderr)
    stops = () if args.ignore_eos else eos_ids(loaded.ref.tokenizer_dir, tokenizer, model.cfg)
    out = generate(model, [ids], max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_ids=stops, **images)[0]
    dt = time.perf_counter() - t0
    text = tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=True)
    print(text)
    if args.show_ids:
        print(json.dumps({"prompt_ids": ids, "new_ids": out}))
    print(f"[{len(out)} tokens in {dt:.1f}s, {model.cfg.model_type}, {args.dtype}]", file=sys.stderr)
    return 0
