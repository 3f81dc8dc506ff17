"""`surojax serve MODEL [--port P] [--api-key K] [--enable-lora --lora-modules NAME=PATH ...
[--allow-runtime-lora --lora-root DIR]]` or `surojax serve FILE.yaml` (several models, sleep mode:
`cli.serve_file`): an
OpenAI-compatible HTTP server with continuous batching, paged KV cache, prefix caching, streaming and runtime
LoRA (docs/serving.md). scripts/serve.py is the same entry point. The options fill a `ServeConfig`
(`serve_config`), whose defaults are the defaults here. Nothing heavy is imported until `run`."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import sys

from surojax.cli.common import non_negative_int, positive_int
from surojax.models.layers.attention_backend import AttentionBackend, parse_attention_backend
from surojax.serve.config import (EngineConfig, KVCacheDtype, KVPath, LoraServeConfig, SchedulerConfig, ServeConfig, SpecMethod,
                                  SpeculativeConfig)


_SERVE, _ENGINE, _LORA = ServeConfig(model=""), EngineConfig(), LoraServeConfig()
_SCHED = _SERVE.engine.scheduler
_SPEC = SpeculativeConfig(SpecMethod.NGRAM)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="HF model folder, .gguf file, surojax run or output folder, "
                                                      "PEFT adapter folder, or a Hub id (org/name[@revision], "
                                                      "org/name:QUANT); or a serve config .yaml with several "
                                                      "models (docs/serving.md)")
    parser.add_argument("--host", default=_SERVE.host)
    parser.add_argument("--port", type=_port, default=_SERVE.port)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as 'model'")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=_SERVE.dtype,
                        help="auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--attention", default=str(_SERVE.attention),
                        help="attention backend: auto | xla | cudnn | cudnn:M | cudnn:M:nocheck")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest prompt + completion (default: the model's, at most 8192)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=_SCHED.max_num_seqs, help="sequences batched at once")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=_SCHED.max_num_batched_tokens,
                        help="tokens per engine step (prompt tokens prefilled with the running decodes)")
    parser.add_argument("--max-queue", type=non_negative_int, default=_SERVE.max_queue,
                        help="waiting requests beyond max-num-seqs (then 429 with Retry-After)")
    parser.add_argument("--max-request-bytes", type=positive_int, default=_SERVE.max_request_bytes,
                        help="largest request body in bytes (then 413)")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="fetch http(s) image URLs of chat requests (off: such a request is a 400; data: URLs "
                             "and local files are read either way)")
    parser.add_argument("--block-size", type=positive_int, default=_ENGINE.block_size, help="tokens per KV block")
    parser.add_argument("--decode-steps", type=_decode_steps, default=AUTO,
                        help=f"decode tokens per device call when no request waits: auto (= {_SCHED.decode_steps}, "
                             "or 1 with a draft model or an MTP head) or a power of two (1, 2, 4, 8, ...)")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="inline the layer loop (faster decode, longer compiles; same results)")
    parser.add_argument("--kv-path", choices=[p.value for p in KVPath], default=_ENGINE.kv_path.value,
                        help="decode KV access: auto (pallas on a GPU where it applies, else paged), "
                             "paged (attention reads the pool in place through block tables), "
                             "reduce / pallas (the same, decode attention as multiply + reduce / in a Pallas "
                             "kernel), reference (gather/scatter)")
    parser.add_argument("--kv-cache-dtype", choices=[d.value for d in KVCacheDtype],
                        default=_ENGINE.kv_cache_dtype.value,
                        help="what the KV cache stores: auto (the model's dtype) or fp8 (float8_e4m3fn with a "
                             "per-layer scale bounded from the weights: 2x the tokens; docs/serving.md)")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV blocks (default: from free device memory; a fixed size on CPU)")
    parser.add_argument("--kv-capacity", type=_kv_capacity, default=None, metavar="N|auto",
                        help="total KV cache capacity in tokens (Surogate's flag): N is ceil(N / block-size) KV "
                             "blocks; auto sizes it from free device memory (the default, as --num-kv-blocks "
                             "unset)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=_ENGINE.memory_utilization)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters picked per request")
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH", help="PEFT adapters to load")
    parser.add_argument("--max-loras", type=positive_int, default=_LORA.max_loras, help="adapter slots")
    parser.add_argument("--max-lora-rank", type=positive_int, default=_LORA.max_rank)
    parser.add_argument("--allow-runtime-lora", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: 403); adapters are "
                             "read only from inside --lora-root")
    parser.add_argument("--lora-root", default=None, metavar="DIR",
                        help="the one directory runtime adapters are read from (required with --allow-runtime-lora)")
    parser.add_argument("--speculative-method", choices=[m.value for m in SpecMethod], default=None,
                        help="speculative decoding: ngram (prompt lookup), draft (--speculative-model) or mtp "
                             "(the checkpoint's multi-token-prediction head: Qwen3.5 / 3.6); default off")
    parser.add_argument("--speculative-model", default=None, metavar="DIR",
                        help="the draft model (same tokenizer / vocabulary as MODEL; any supported family)")
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                        help=f"tokens proposed per sequence per step (default {_SPEC.num_tokens})")
    parser.add_argument("--speculative-disable-by-batch-size", type=positive_int, default=None, metavar="N",
                        help="ngram: no speculation in a step with more than N running requests (default: never)")
    parser.add_argument("--log-level", default=_SERVE.log_level)


AUTO = "auto"
SERVE_FILE_SUFFIXES = (".yaml", ".yml")  # MODEL is a serve config file (`cli.serve_file`: several models)


def _kv_capacity(value: str) -> int | str:
    return AUTO if value == AUTO else positive_int(value)


def kv_blocks(num_kv_blocks: int | None, kv_capacity: int | str | None, block_size: int) -> int | None:
    """The KV pool's block count from --num-kv-blocks or --kv-capacity (tokens, or auto = None: sized from free
    device memory, capacity.num_kv_blocks); both at once is an error."""
    if kv_capacity is not None and num_kv_blocks is not None:
        raise ServeOptionError("--kv-capacity and --num-kv-blocks both size the KV cache: give one")
    if kv_capacity is None or kv_capacity == AUTO:
        return num_kv_blocks
    return -(-kv_capacity // block_size)


def _decode_steps(value: str) -> int | str:
    return AUTO if value == AUTO else _power_of_two(value)


def resolve_decode_steps(value: int | str, speculative: SpecMethod | None) -> int:
    """--decode-steps: auto -> ServeConfig's default (SERVE_DECODE_STEPS: multi-step runs only while no request
    waits and every running request decodes, so it costs a waiting request at most one call; with n-gram
    speculation, only in steps where no request has proposals), or 1 with a draft model or an MTP head (whose
    pools follow the target one token a step); an explicit K as given."""
    if value == AUTO:
        return 1 if speculative in (SpecMethod.DRAFT, SpecMethod.MTP) else _SCHED.decode_steps
    return value


def _power_of_two(value: str) -> int:
    n = positive_int(value)
    if n & (n - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two (got {n})")
    return n


def _port(value: str) -> int:
    n = positive_int(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number <= 65535 (got {n})")
    return n


class ServeOptionError(ValueError):
    is_user_error = True


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The parsed options as a `ServeConfig` (max-num-batched-tokens is raised to at least one block)."""
    lora = None
    if (args.allow_runtime_lora or args.lora_root) and not args.enable_lora:
        raise ServeOptionError("--allow-runtime-lora and --lora-root need --enable-lora")
    if args.allow_runtime_lora != bool(args.lora_root):
        raise ServeOptionError("--allow-runtime-lora and --lora-root DIR go together: runtime adapters are read only "
                               "from inside that directory")
    if args.lora_root and not os.path.isdir(args.lora_root):
        raise ServeOptionError(f"--lora-root {args.lora_root!r} is not a directory")
    if args.enable_lora:
        modules = []
        for spec in args.lora_modules:
            name, _, path = spec.partition("=")
            if not name or not path:
                raise ServeOptionError(f"--lora-modules takes NAME=PATH, got {spec!r}")
            modules.append((name, path))
        lora = LoraServeConfig(max_loras=args.max_loras, max_rank=args.max_lora_rank, modules=tuple(modules),
                               allow_runtime=args.allow_runtime_lora, root=args.lora_root)
    elif args.lora_modules:
        raise ServeOptionError("--lora-modules needs --enable-lora")
    speculative = None
    if args.speculative_method is not None:
        try:
            speculative = SpeculativeConfig(SpecMethod(args.speculative_method),
                                            num_tokens=args.num_speculative_tokens or _SPEC.num_tokens,
                                            model=args.speculative_model,
                                            disable_by_batch_size=args.speculative_disable_by_batch_size)
        except ValueError as e:
            raise ServeOptionError(str(e)) from None
    elif (args.speculative_model is not None or args.num_speculative_tokens is not None
          or args.speculative_disable_by_batch_size is not None):
        raise ServeOptionError("--speculative-model, --num-speculative-tokens and --speculative-disable-by-batch-size "
                               "need --speculative-method")
    method = speculative.method if speculative is not None else None
    if method is SpecMethod.MTP and args.enable_lora:
        raise ServeOptionError("--speculative-method mtp is not supported with --enable-lora (the checkpoint's MTP "
                               "head predicts the base model): use ngram or draft")
    decode_steps = resolve_decode_steps(args.decode_steps, method)
    if method in (SpecMethod.DRAFT, SpecMethod.MTP) and decode_steps > 1:
        raise ServeOptionError(f"--speculative-method {method.value} is not supported with --decode-steps > 1 "
                               "(use ngram, or --decode-steps 1)")
    if args.kv_cache_dtype == KVCacheDtype.FP8.value and args.enable_lora:
        raise ServeOptionError("--kv-cache-dtype fp8 is not supported with --enable-lora (the FP8 scales are "
                               "bounded from the base weights, which an adapter changes)")
    if speculative is not None and args.kv_path == KVPath.REFERENCE.value:
        raise ServeOptionError("speculative decoding needs a paged --kv-path (not reference)")
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=max(args.max_num_batched_tokens, args.block_size),
                                max_model_len=args.max_model_len, decode_steps=decode_steps)
    num_blocks = kv_blocks(args.num_kv_blocks, args.kv_capacity, args.block_size)
    engine = EngineConfig(scheduler=scheduler, block_size=args.block_size, num_blocks=num_blocks,
                          memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_caching, kv_path=KVPath(args.kv_path),
                          unroll_layers=args.unroll_layers, speculative=speculative,
                          kv_cache_dtype=KVCacheDtype(args.kv_cache_dtype))
    return ServeConfig(model=args.model, engine=engine, host=args.host, port=args.port, api_key=args.api_key,
                       served_model_name=args.served_model_name, tokenizer=args.tokenizer, dtype=args.dtype,
                       attention=_attention(args.attention), max_queue=args.max_queue,
                       max_request_bytes=args.max_request_bytes, lora=lora, log_level=args.log_level,
                       allow_remote_images=args.allow_remote_images)


def default_options(model: str) -> argparse.Namespace:
    """`surojax serve MODEL` with every option at its default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser.parse_args([model])


def _attention(text: str) -> AttentionBackend:
    try:
        return parse_attention_backend(text, key="--attention")
    except ValueError as e:
        raise ServeOptionError(str(e)) from None


class QuietBackendProbe(logging.Filter):
    """Drops jax's INFO record for each optional backend it could not start ("Unable to initialize backend 'tpu'"
    on a GPU or CPU machine): noise in the server's log. A backend the user asked for still fails loudly."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to initialize backend")


JAX_BACKEND_LOGGER = "jax._src.xla_bridge"

# The HTTP server's packages. They are base dependencies (pyproject.toml), so `bash scripts/run.sh` installs them;
# an environment made otherwise may lack them, which `surojax serve` says before any heavy work.
SERVING_PACKAGES = ("fastapi", "uvicorn")


def install_command(packages: tuple[str, ...] = SERVING_PACKAGES) -> str:
    """The command that installs `packages` into the environment running this process."""
    return shlex.join([sys.executable, "-m", "pip", "install", *packages])


def missing_serving_packages() -> list[str]:
    return [p for p in SERVING_PACKAGES if importlib.util.find_spec(p) is None]


def require_serving_packages() -> None:
    """ServeOptionError (one line: what is missing and the install command) unless fastapi and uvicorn import."""
    missing = missing_serving_packages()
    if missing:
        raise ServeOptionError(f"surojax serve needs {' and '.join(missing)}, which this Python environment "
                               f"({sys.prefix}) does not have; install with: {install_command()}")


def run(args: argparse.Namespace) -> int:
    require_serving_packages()
    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    try:
        from surojax.serve.launch import serve
    except ModuleNotFoundError as e:  # a serving package that is there but broken (one of its own imports missing)
        if e.name is None or e.name.split(".")[0] not in (*SERVING_PACKAGES, "starlette"):
            raise
        raise ServeOptionError(f"surojax serve cannot import {e.name} ({e}); reinstall with: "
                               f"{install_command()}") from None

    probe_log = logging.getLogger(JAX_BACKEND_LOGGER)
    if not any(isinstance(f, QuietBackendProbe) for f in probe_log.filters):
        probe_log.addFilter(QuietBackendProbe())
    if args.model.endswith(SERVE_FILE_SUFFIXES):  # several models (or sleep mode) from a serve config YAML
        from surojax.cli.serve_file import check_no_options, read_serve_file
        check_no_options(args, default_options)
        return serve(read_serve_file(args.model, default_options, serve_config))
    return serve(serve_config(args))
