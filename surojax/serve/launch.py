"""Build the server from command-line options: resolve MODEL, load weights + tokenizer, size the KV cache,
wrap LoRA slots, start the engine thread, make the FastAPI app. `surojax serve` and scripts/serve.py call
`serve(args)`; tests and the load generator call `build_server` and run uvicorn themselves.

MODEL is an HF safetensors folder (config.json + *.safetensors + tokenizer files), a surojax output folder
(its `model/`, `merged/`, or `adapter/` whose adapter_config.json names the base), or a .gguf file (needs
`surojax.weights.gguf_checkpoint.load_gguf_model`, which issue 5's loader brings).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from surojax.serve.api_server import ServerState, build_app
from surojax.serve.async_engine import AsyncEngine
from surojax.serve.generate import eos_ids

log = logging.getLogger("surojax.serve")


class ServeError(ValueError):
    is_user_error = True


def resolve_model(path: str | Path) -> tuple[Path, Path | None]:
    """MODEL -> (model folder, adapter folder to fold in or None)."""
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p, None
    for sub in ("merged", "model"):
        if (p / sub / "config.json").is_file():
            return p / sub, None
    adapter = p / "adapter" if (p / "adapter" / "adapter_config.json").is_file() else p
    if (adapter / "adapter_config.json").is_file():
        base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ServeError(f"{adapter}: an adapter without base_model_name_or_path; serve the base model with "
                             f"--enable-lora --lora-modules NAME={adapter}")
        from surojax.data.hub import resolve_local

        return Path(resolve_local(base)), adapter
    raise ServeError(f"{p}: not a model folder (no config.json), surojax output folder (model/, merged/ or "
                     "adapter/) or .gguf file")


def _dtype(name: str):
    import jax
    import jax.numpy as jnp

    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def load_for_serving(args):
    """-> (model, tokenizer, model_dir, served name)."""
    from surojax.data.tokenizer import Tokenizer
    from surojax.weights.hf_checkpoint import load_model

    dtype = _dtype(args.dtype)
    path = Path(args.model).expanduser()
    if path.suffix == ".gguf":
        try:
            from surojax.weights.gguf_checkpoint import load_gguf_model
        except ImportError:
            raise ServeError(f"{path}: GGUF serving lands with issue 5's loader "
                             "(surojax.weights.gguf_checkpoint.load_gguf_model is not there yet)") from None
        if not path.is_file():
            raise ServeError(f"{path} does not exist")
        # issue 5's loader: (cfg, Decoder, Tokenizer from the file's metadata); quantised kernels are kept
        loaded = load_gguf_model(path, dtype=dtype, param_dtype=dtype, attention=args.attention)
        model, tokenizer = (loaded[1], loaded[2]) if isinstance(loaded, tuple) else (loaded, None)
        if args.tokenizer:
            tokenizer = Tokenizer.from_dir(args.tokenizer)
        if tokenizer is None:
            raise ServeError(f"{path}: no tokenizer in the GGUF metadata; give --tokenizer DIR")
        return model, tokenizer, None, args.served_model_name or path.stem
    if not path.exists():
        raise ServeError(f"{path} does not exist")
    model_dir, adapter = resolve_model(path)
    model = load_model(model_dir, dtype=dtype, param_dtype=dtype, attention=args.attention)
    if adapter is not None:
        from surojax.peft.stacked import load_adapter_into

        log.info("folding the adapter %s into its base %s", adapter, model_dir)
        load_adapter_into(model, adapter, trainable=False)
    tok_dir = Path(args.tokenizer) if args.tokenizer else (adapter if adapter and (adapter / "tokenizer.json").is_file()
                                                          else model_dir)
    return model, Tokenizer.from_dir(tok_dir), model_dir, args.served_model_name or path.name


def build_server(args, model=None, tokenizer=None):
    """-> (FastAPI app, ServerState); the engine thread is started. `model`/`tokenizer` skip loading."""
    from surojax.serve.engine import Engine

    model_dir = None
    if model is None:
        model, tokenizer, model_dir, name = load_for_serving(args)
    else:
        name = args.served_model_name or "model"
    cfg = model.cfg
    max_len = args.max_model_len or cfg.max_position_embeddings or 4096
    if args.max_model_len is None and max_len > 8192:
        log.info("--max-model-len defaults to 8192 (the model allows %d)", max_len)
        max_len = 8192
    lora = None
    if args.enable_lora:
        from surojax.peft.multi_lora import AdapterSlots

        lora = AdapterSlots(model, max_loras=args.max_loras, max_rank=args.max_lora_rank)
    engine = Engine(model, num_blocks=args.num_kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=max(args.max_num_batched_tokens, args.block_size),
                    max_model_len=max_len, enable_prefix_caching=not args.no_prefix_caching, tokenizer=tokenizer,
                    lora=lora, memory_utilization=args.gpu_memory_utilization,
                    decode_steps=getattr(args, "decode_steps", 1),
                    unroll_layers=getattr(args, "unroll_layers", False),
                    paged_attention=getattr(args, "kv_path", "auto") != "reference",
                    paged_kernel={"paged": "gather", "reference": "gather"}.get(getattr(args, "kv_path", "auto"),
                                                                                getattr(args, "kv_path", "auto")))
    for spec in args.lora_modules or ():
        if lora is None:
            raise ServeError("--lora-modules needs --enable-lora")
        lname, _, lpath = spec.partition("=")
        if not lname or not lpath:
            raise ServeError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        engine.load_lora(lname, lpath)
    log.info("KV cache: %d blocks x %d tokens; max-model-len %d; max-num-seqs %d", engine.kv.num_blocks,
             args.block_size, max_len, args.max_num_seqs)
    # The engine thread and the HTTP event loop share the GIL; Python's default 5 ms switch interval would let
    # one hold it for 5 ms while the other waits (a decode step is ~1 ms). A process-wide setting, set here
    # because this process is the server.
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    state = ServerState(engine=AsyncEngine(engine, max_queue=args.max_queue).start(), tokenizer=tokenizer,
                        model_name=name, max_model_len=max_len, eos_ids=eos_ids(model_dir, tokenizer, cfg),
                        api_key=args.api_key, model_path=str(args.model))
    return build_app(state), state


def serve(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, state = build_server(args)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        state.engine.shutdown()
    return 0
