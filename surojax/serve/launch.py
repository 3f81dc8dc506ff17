"""Build the server from command-line options: resolve MODEL, load weights + tokenizer, size the KV cache,
wrap LoRA slots, start the engine thread, make the FastAPI app. `surojax serve` and scripts/serve.py call
`serve(args)`; tests and the load generator call `build_server` and run uvicorn themselves.

MODEL is any model reference (surojax.weights.model_ref): an HF safetensors folder, a surojax output folder (its
`merged/`, `model/`, or `adapter/` whose adapter_config.json names the base), a PEFT adapter folder, a .gguf
file, or a repo id in the local HF cache.
"""
from __future__ import annotations

import logging
import sys

from surojax.model_loader import load_model_ref
from surojax.serve.api_server import ServerState, build_app
from surojax.serve.async_engine import AsyncEngine
from surojax.serve.generate import eos_ids

log = logging.getLogger("surojax.serve")


class ServeError(ValueError):
    is_user_error = True


def _dtype(name: str):
    import jax
    import jax.numpy as jnp

    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def load_for_serving(args):
    """-> (model, tokenizer, folder with generation_config.json or None, served name). MODEL is any reference
    surojax.model_loader loads (an adapter it names is folded in; GGUF kernels stay quantised)."""
    loaded = load_model_ref(args.model, dtype=_dtype(args.dtype), attention=args.attention, keep_quantized=True,
                            tokenizer_dir=args.tokenizer)
    return loaded.model, loaded.tokenizer, loaded.ref.tokenizer_dir, args.served_model_name or loaded.ref.name


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
