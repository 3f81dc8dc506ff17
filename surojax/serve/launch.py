"""Build the server from a `ServeConfig`: resolve MODEL, load weights + tokenizer, size the KV cache, wrap LoRA
slots, start the engine thread, make the FastAPI app. `surojax serve` and scripts/serve.py fill the config
(`surojax.cli.serve.serve_config`) and call `serve(config)`; tests and the load generator call `build_server`
and run uvicorn themselves.

MODEL is an HF safetensors folder (config.json + *.safetensors + tokenizer files), a surojax output folder
(its `model/`, `merged/`, or `adapter/` whose adapter_config.json names the base), or a .gguf file (needs
`surojax.weights.gguf_checkpoint.load_gguf_model`, which issue 5's loader brings).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from surojax.generation.loop import eos_ids
from surojax.serve.api_server import ServerState, build_app
from surojax.serve.async_engine import AsyncEngine
from surojax.serve.config import ServeConfig

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


def load_for_serving(config: ServeConfig):
    """-> (model, tokenizer, model_dir, served name)."""
    from surojax.data.tokenizer import Tokenizer
    from surojax.weights.hf_checkpoint import load_model

    dtype = _dtype(config.dtype)
    path = Path(config.model).expanduser()
    if path.suffix == ".gguf":
        try:
            from surojax.weights.gguf_checkpoint import load_gguf_model
        except ImportError:
            raise ServeError(f"{path}: GGUF serving lands with issue 5's loader "
                             "(surojax.weights.gguf_checkpoint.load_gguf_model is not there yet)") from None
        if not path.is_file():
            raise ServeError(f"{path} does not exist")
        # issue 5's loader: (cfg, Decoder, Tokenizer from the file's metadata); quantised kernels are kept
        loaded = load_gguf_model(path, dtype=dtype, param_dtype=dtype, attention=config.attention)
        model, tokenizer = (loaded[1], loaded[2]) if isinstance(loaded, tuple) else (loaded, None)
        if config.tokenizer:
            tokenizer = Tokenizer.from_dir(config.tokenizer)
        if tokenizer is None:
            raise ServeError(f"{path}: no tokenizer in the GGUF metadata; give --tokenizer DIR")
        return model, tokenizer, None, config.served_model_name or path.stem
    if not path.exists():
        raise ServeError(f"{path} does not exist")
    model_dir, adapter = resolve_model(path)
    model = load_model(model_dir, dtype=dtype, param_dtype=dtype, attention=config.attention)
    if adapter is not None:
        from surojax.peft.stacked import load_adapter_into

        log.info("folding the adapter %s into its base %s", adapter, model_dir)
        load_adapter_into(model, adapter, trainable=False)
    if config.tokenizer:
        tok_dir = Path(config.tokenizer)
    else:
        tok_dir = adapter if adapter and (adapter / "tokenizer.json").is_file() else model_dir
    return model, Tokenizer.from_dir(tok_dir), model_dir, config.served_model_name or path.name


def build_server(config: ServeConfig, model=None, tokenizer=None):
    """-> (FastAPI app, ServerState); the engine thread is started. `model`/`tokenizer` skip loading."""
    from surojax.serve.engine import Engine

    model_dir = None
    if model is None:
        model, tokenizer, model_dir, name = load_for_serving(config)
    else:
        name = config.served_model_name or "model"
    lora = None
    if config.lora is not None:
        from surojax.peft.multi_lora import AdapterSlots

        lora = AdapterSlots(model, max_loras=config.lora.max_loras, max_rank=config.lora.max_rank)
    engine = Engine(model, config.engine, tokenizer=tokenizer, lora=lora)
    for lname, lpath in config.lora.modules if config.lora is not None else ():
        engine.load_lora(lname, lpath)
    resolved = engine.config
    log.info("KV cache: %d blocks x %d tokens; max-model-len %d; max-num-seqs %d; KV path %s", resolved.num_blocks,
             resolved.block_size, engine.max_model_len, resolved.scheduler.max_num_seqs, resolved.kv_path.value)
    # The engine thread and the HTTP event loop share the GIL; Python's default 5 ms switch interval would let
    # one hold it for 5 ms while the other waits for a decode step. A process-wide setting, set here because
    # this process is the server.
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    state = ServerState(engine=AsyncEngine(engine, max_queue=config.max_queue).start(), tokenizer=tokenizer,
                        model_name=name, max_model_len=engine.max_model_len,
                        eos_ids=eos_ids(model_dir, tokenizer, model.cfg), api_key=config.api_key,
                        model_path=str(config.model))
    return build_app(state), state


def serve(config: ServeConfig) -> int:
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, state = build_server(config)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    finally:
        state.engine.shutdown()
    return 0
