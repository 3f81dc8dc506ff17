"""Build the server from a `ServeConfig`: resolve MODEL, load weights + tokenizer, size the KV cache, wrap LoRA
slots, start the engine thread, make the FastAPI app. `surojax serve` and scripts/serve.py fill the config
(`surojax.cli.serve.serve_config`) and call `serve(config)`; tests and the load generator call `build_server`
and run uvicorn themselves.

MODEL is any model reference (surojax.weights.model_ref): an HF safetensors folder, a surojax output folder (its
`merged/`, `model/`, or `adapter/` whose adapter_config.json names the base), a PEFT adapter folder, a .gguf
file, or a Hugging Face Hub id (surojax.hub fetches it; so too the draft model and --lora-modules NAME=REF).

Several models (`MultiServeConfig`, read from a serve config YAML by `surojax.cli.serve_file`): `build_multi_server`
builds each model's server as above, one after the other, each engine sized with the device memory the models
before it hold left out of its share (`EngineConfig.others_bytes_in_use`), and puts `serve.model_router` in
front.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import sys

import jax
import jax.numpy as jnp

from surojax.compilation_cache import enable_compilation_cache
from surojax.data.sources import DataError
from surojax.data.vision_data import TextOnly, VisionData, model_vision
from surojax.generation.loop import eos_ids
from surojax.hub import model_path
from surojax.kernel_settings import kernel_settings
from surojax.model_loader import LoadedModel, load_model_ref
from surojax.peft.multi_lora import AdapterSlots
from surojax.quant.laid_out import decode_weights
from surojax.serve.api_server import ServerState, build_app
from surojax.serve.async_engine import AsyncEngine
from surojax.serve.config import MultiServeConfig, ServeConfig, SpecMethod
from surojax.serve.engine import Engine
from surojax.serve.lora_root import LoraRoot
from surojax.serve.model_router import ModelTable, RoutedModel, build_router_app
from surojax.weights.mtp_checkpoint import MTPError, load_mtp

log = logging.getLogger("surojax.serve")


def _dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def load_served(config: ServeConfig) -> LoadedModel:
    """MODEL is any reference surojax.model_loader loads (an adapter it names is folded in; the quantised kernels
    of a GGUF file or of a pre-quantised HF checkpoint stay quantised)."""
    return load_model_ref(config.model, dtype=_dtype(config.dtype), attention=config.attention,
                          keep_quantized=True, tokenizer_dir=config.tokenizer)


def load_for_serving(config: ServeConfig):
    """-> (model, tokenizer, folder with generation_config.json or None, served name)."""
    loaded = load_served(config)
    return loaded.model, loaded.tokenizer, loaded.ref.tokenizer_dir, config.served_model_name or loaded.ref.name


def load_draft(config: ServeConfig):
    """The speculative draft model named by the config (None unless the method is 'draft'), in the server's
    dtype and attention backend."""
    spec = config.engine.speculative
    if spec is None or spec.method is not SpecMethod.DRAFT:
        return None
    return load_model_ref(spec.model, dtype=_dtype(config.dtype), attention=config.attention,
                          keep_quantized=True).model


def load_mtp_head(config: ServeConfig, model, model_dir):
    """The served model's MTP head (None unless the method is 'mtp'), read from its checkpoint folder
    (`weights.mtp_checkpoint.load_mtp`: refused, naming what is missing, for a model without one)."""
    spec = config.engine.speculative
    if spec is None or spec.method is not SpecMethod.MTP:
        return None
    if model_dir is None:
        raise MTPError("--speculative-method mtp reads the MTP head (mtp.* tensors) from the served model's "
                       "Hugging Face folder; this model was not loaded from one")
    return load_mtp(model_dir, model, attention=config.attention)


def served_vision(model_dir, has_tower: bool = True) -> VisionData | TextOnly:
    """The images the served model takes (vision_data.model_vision of its folder). A vision model whose folder
    cannot take images (no preprocessor_config.json ...) or whose loaded model has no vision tower (has_tower
    False: no model.visual.* tensors) is served for text, and image requests get the reason."""
    if model_dir is None:
        return TextOnly("the served model's folder is not known (a model object was given)")
    try:
        vision = model_vision(model_dir)
    except DataError as e:
        log.warning("image requests will be refused: %s", e)
        return TextOnly(str(e))
    if isinstance(vision, VisionData) and not has_tower:
        reason = "the served model has no vision tower (its checkpoint holds no model.visual.* tensors)"
        log.warning("image requests will be refused: %s", reason)
        return TextOnly(reason)
    return vision


def build_server(config: ServeConfig, model=None, tokenizer=None):
    """-> (FastAPI app, ServerState); the engine thread is started. `model`/`tokenizer` skip loading (the
    draft model of speculative decoding is always loaded from its reference)."""
    model_dir, vision_dir, lora_root = None, None, None
    if config.lora is not None and config.lora.allow_runtime:
        lora_root = LoraRoot.at(config.lora.root)  # a missing root fails before the weights load
    # --lora-modules NAME=REF: a folder, or a Hub adapter repo fetched now (a bad one fails before the weights load)
    adapters = [(lname, model_path(ref)) for lname, ref in (config.lora.modules if config.lora is not None else ())]
    if model is None:
        loaded = load_served(config)
        model, tokenizer, model_dir = loaded.model, loaded.tokenizer, loaded.ref.tokenizer_dir
        vision_dir, name = loaded.ref.model_dir, config.served_model_name or loaded.ref.name
    else:
        name = config.served_model_name or "model"
    decode_weights(model, join_projections=config.lora is None)  # LoRA slots wrap q / k / v ... by name
    lora = None
    if config.lora is not None:
        lora = AdapterSlots(model, max_loras=config.lora.max_loras, max_rank=config.lora.max_rank)
    draft = load_draft(config)
    if draft is not None:
        decode_weights(draft)
    mtp = load_mtp_head(config, model, vision_dir)
    if mtp is not None:
        decode_weights(mtp)
    engine = Engine(model, config.engine, tokenizer=tokenizer, lora=lora, draft_model=draft, mtp_head=mtp)
    for lname, lpath in adapters:
        engine.load_lora(lname, lpath)
    resolved = engine.config
    pools = jax.tree.leaves((engine.runner.k_pool, engine.runner.v_pool))  # one k / v pair per KV shape
    log.info("KV cache: %d blocks x %d tokens (%s, %.2f GiB); max-model-len %d; max-num-seqs %d; KV path %s",
             resolved.num_blocks, resolved.block_size, jnp.dtype(pools[0].dtype).name,
             sum(p.nbytes for p in pools) / 2**30,
             engine.max_model_len, resolved.scheduler.max_num_seqs, resolved.kv_path.value)
    if engine.runner.state_pool is not None:
        log.info("linear-attention state slots: %d (%.2f GiB)", resolved.scheduler.max_num_seqs,
                 sum(x.nbytes for x in jax.tree.leaves(engine.runner.state_pool)) / 2**30)
    if resolved.speculative is not None:
        log.info("speculative decoding: %s, %d tokens per step", resolved.speculative.method.value,
                 resolved.speculative.num_tokens)
    for line in kernel_settings().summary_lines():  # an A/B override of a kernel choice is never silent
        log.warning("%s", line)
    # The engine thread and the HTTP event loop share the GIL; Python's default 5 ms switch interval would let
    # one hold it for 5 ms while the other waits for a decode step. A process-wide setting, set here because
    # this process is the server.
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    state = ServerState(engine=AsyncEngine(engine, max_queue=config.max_queue).start(), tokenizer=tokenizer,
                        model_name=name, max_model_len=engine.max_model_len,
                        eos_ids=eos_ids(model_dir, tokenizer, model.cfg), api_key=config.api_key,
                        model_path=str(config.model), lora_root=lora_root,
                        max_request_bytes=config.max_request_bytes,
                        vision=served_vision(vision_dir, engine.runner.vision is not None),
                        allow_remote_images=config.allow_remote_images)
    return build_app(state), state


def device_bytes_in_use(device=None) -> int:
    """Device memory in use now (0 where the device keeps no statistics: CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU backends raise or return None
        stats = {}
    return int(stats.get("bytes_in_use", 0))


def build_multi_server(config: MultiServeConfig):
    """-> (the router app, ModelTable): one server per model (`build_server`, engine threads started), in order;
    a model's gpu_memory_utilization is its own share (the models loaded before it are left out)."""
    models = []
    try:
        for m in config.models:
            engine = dataclasses.replace(m.serve.engine, others_bytes_in_use=device_bytes_in_use())
            serve_config = dataclasses.replace(m.serve, engine=engine, api_key=config.api_key,
                                               max_request_bytes=config.max_request_bytes)
            app, state = build_server(serve_config)
            log.info("model %s served from %s", state.model_name, m.serve.model)
            models.append(RoutedModel(state, app, m.sleep_after_idle_s))
    except BaseException:
        for routed in models:
            routed.state.engine.shutdown()
        raise
    table = ModelTable(models, enable_sleep_mode=config.enable_sleep_mode)
    return build_router_app(table, api_key=config.api_key, max_request_bytes=config.max_request_bytes), table


def freeze_heap() -> None:
    """Take every object alive now (the model, JAX, FastAPI: ~10^5 and more) out of the cyclic GC's generations.
    A full collection walks them all with the GIL held (~80 ms on the debug shape, every few seconds at 64
    streams), stalling the engine thread. For a server that lives until the process ends (`gc.unfreeze` gives
    them back)."""
    gc.collect()
    gc.freeze()


def serve(config: ServeConfig | MultiServeConfig) -> int:
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the serving calls compile on first use of each bucket (a prefill call ~1-3 s, a verify call ~1.5 s on an
    # H100); with JAX's persistent cache a restarted server loads them from disk, as training does
    cache = enable_compilation_cache(jax.devices()[0].platform)
    if cache is not None:
        log.info("compiled programs cached in %s (SUROJAX_CACHE_DIR=off turns it off)", cache)
    if isinstance(config, MultiServeConfig):
        app, table = build_multi_server(config)
        engines = [m.state.engine for m in table.models]
    else:
        app, state = build_server(config)
        engines = [state.engine]
    freeze_heap()
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    finally:
        for engine in engines:
            engine.shutdown()
    return 0
