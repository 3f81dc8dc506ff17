"""Every serving setting and its default, once: `SchedulerConfig` (what the scheduler reads), `RunnerBuckets`
(the runner's smallest shape buckets), `EngineConfig` (the engine: KV pool, KV path, loops) and `ServeConfig`
(the HTTP server around it); `MultiServeConfig` (several `ServedModel`s behind one server). The CLI (`surojax serve`, scripts/serve.py) fills a `ServeConfig`; `Engine`,
`Scheduler` and the server take these typed values, never an argparse namespace. Imports nothing heavy (the CLI
builds a config before loading JAX).
"""
from __future__ import annotations

import dataclasses
import enum

from surojax.models.layers.attention_backend import AUTO as AUTO_ATTENTION, AttentionBackend, as_attention_backend

DEFAULT_MAX_MODEL_LEN_CAP = 8192  # max_model_len None: the model's max_position_embeddings, at most this
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 128k-token prompt as text (~0.5 MiB) or as token ids (~0.9 MiB), with room


class KVPath(enum.Enum):
    """How the runner's forward reads and writes the KV pool.

    PAGED / REDUCE / PALLAS: the decoder reads and writes the pool in place through block tables
    (`PagedKVCache`), decode attention by `PagedKernel` GATHER / REDUCE / PALLAS. REFERENCE: each call gathers the
    rows' context into a dense view and scatters the new k/v back (`serve.kv_reference`). AUTO: PALLAS on a GPU
    where the kernel applies, else PAGED (`Engine` decides once, `resolve_kv_path`)."""

    AUTO = "auto"
    PAGED = "paged"
    REDUCE = "reduce"
    PALLAS = "pallas"
    REFERENCE = "reference"


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: sequences running at once; max_num_batched_tokens: tokens per step (prefill chunks with
    the running decodes); max_model_len: longest prompt + completion (None: the model's
    max_position_embeddings, at most DEFAULT_MAX_MODEL_LEN_CAP, resolved by `Engine`); chunk_size: longest
    prefill chunk (None: max_num_batched_tokens); decode_steps K (a power of two): decode tokens per device
    call when nothing waits (`multi_step`)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    chunk_size: int | None = None
    decode_steps: int = 1

    def __post_init__(self):
        _positive("SchedulerConfig", max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                  chunk_size=self.chunk_size, decode_steps=self.decode_steps)
        if self.decode_steps & (self.decode_steps - 1):
            raise ValueError(f"decode_steps must be a power of two >= 1, got {self.decode_steps}")


@dataclasses.dataclass(frozen=True)
class RunnerBuckets:
    """The runner's smallest shape buckets: decode rows R, prefill rows R, context S and prefill length T (fewer
    compilations, more padding). fine_prefill_rows: a prefill call's rows are rounded up to 2^k or 1.5 x 2^k
    (17 -> 24) instead of 2^k (17 -> 32): less padding, up to twice the compiled prefill shapes
    (benchmarks/prefill_step.py --fine-prefill-rows measures it)."""

    min_rows: int = 1
    min_prefill_rows: int = 1
    min_context: int = 0
    min_prefill: int = 1
    fine_prefill_rows: bool = False


class KVCacheDtype(enum.Enum):
    """What the KV pool stores (vLLM's --kv-cache-dtype): AUTO = the model's compute dtype; FP8 =
    float8_e4m3fn codes with a per-layer k / v scale bounded from the weights (`serve.kv_fp8`), half the bytes
    of bf16 per token."""

    AUTO = "auto"
    FP8 = "fp8"


class SpecMethod(enum.Enum):
    """How speculative decoding proposes tokens: NGRAM = prompt lookup (the tokens that followed the last n
    tokens' latest earlier occurrence in prompt + output), DRAFT = a small model with the same vocabulary, MTP = the
    checkpoint's multi-token-prediction head (Qwen3.5 / Qwen3.6 `mtp.*`: models/mtp.py, serve/mtp.py)."""

    NGRAM = "ngram"
    DRAFT = "draft"
    MTP = "mtp"


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`serve.speculative`): `num_tokens` K proposals per decoding sequence per step,
    verified in one target forward over K + 1 positions. method: `SpecMethod`; model: the draft model reference
    (DRAFT only: any folder or file the model loader takes, same vocabulary as the target); ngram_max /
    ngram_min: the n-gram lengths tried, longest first (NGRAM only); disable_by_batch_size (vLLM's key, NGRAM only):
    a step with more running requests than this speculates for none of them (they decode plainly, multi-step
    included: at 16 users n-gram ran at 0.88x of off on an H100, at one user 1.65x; RESULTS.md session 27); None:
    never."""

    method: SpecMethod
    num_tokens: int = 4
    model: str | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if not isinstance(self.method, SpecMethod):
            raise TypeError(f"SpeculativeConfig: method must be a SpecMethod, got {self.method!r}")
        _positive("SpeculativeConfig", num_tokens=self.num_tokens, ngram_max=self.ngram_max,
                  ngram_min=self.ngram_min)
        if self.disable_by_batch_size is not None:
            _positive("SpeculativeConfig", disable_by_batch_size=self.disable_by_batch_size)
            if self.method is not SpecMethod.NGRAM:
                raise ValueError(f"--speculative-disable-by-batch-size is only read by --speculative-method ngram "
                                 f"({self.method.value}'s proposer keeps its own pool in step with every token)")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"SpeculativeConfig: ngram_min {self.ngram_min} > ngram_max {self.ngram_max}")
        if self.method is SpecMethod.DRAFT and not self.model:
            raise ValueError("speculative method 'draft' needs a draft model (--speculative-model DIR)")
        if self.method is not SpecMethod.DRAFT and self.model:
            raise ValueError(f"--speculative-model is only read by --speculative-method draft ({self.method.value} "
                             "has no draft model)")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """block_size: tokens per KV block; num_blocks: KV blocks (None: from free device memory,
    `capacity.num_kv_blocks`, capped for the Pallas kernel's int32 offsets); memory_utilization: the share of
    the device's memory the server may fill; enable_prefix_caching: reuse full blocks across requests; kv_path:
    `KVPath`; kv_in_place (REFERENCE path only): the decoder updates the dense view in its layer scan's carry
    instead of copying it in and out; unroll_layers: the layer loop inlined (longer compiles, same values);
    speculative: `SpeculativeConfig` or None (off); others_bytes_in_use: device memory held by others (the models
    loaded before this one in a multi-model server), not counted against memory_utilization, which is then this
    model's share of the device (its weights and pool); kv_cache_dtype: `KVCacheDtype` (FP8: not with LoRA slots,
    whose adapters would change W_k / W_v after the scales are fixed; the draft's pool keeps its dtype). Speculation is refused
    with the REFERENCE KV path (the verify step reads and writes the pool in place), and with decode_steps > 1 unless
    its method is n-gram lookup (multi-step decode runs in the steps where no request has proposals)."""

    scheduler: SchedulerConfig = SchedulerConfig()
    block_size: int = 16
    num_blocks: int | None = None
    memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_path: KVPath = KVPath.AUTO
    kv_in_place: bool = True
    unroll_layers: bool = False
    buckets: RunnerBuckets = RunnerBuckets()
    speculative: SpeculativeConfig | None = None
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    others_bytes_in_use: int = 0

    def __post_init__(self):
        _positive("EngineConfig", block_size=self.block_size, num_blocks=self.num_blocks)
        if self.speculative is not None:
            if self.scheduler.decode_steps > 1 and self.speculative.method is not SpecMethod.NGRAM:
                raise ValueError(f"speculative method {self.speculative.method.value!r} is not supported with "
                                 f"multi-step decode (decode_steps {self.scheduler.decode_steps}; its pool follows "
                                 "the target one token a step): use decode_steps 1, or the ngram method")
            if self.kv_path is KVPath.REFERENCE:
                raise ValueError("speculative decoding needs a paged KV path (auto, paged, reduce, pallas), "
                                 "not reference")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"EngineConfig: memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if not isinstance(self.kv_path, KVPath):
            raise TypeError(f"EngineConfig: kv_path must be a KVPath, got {self.kv_path!r}")
        if not isinstance(self.kv_cache_dtype, KVCacheDtype):
            raise TypeError(f"EngineConfig: kv_cache_dtype must be a KVCacheDtype, got {self.kv_cache_dtype!r}")


@dataclasses.dataclass(frozen=True)
class LoraServeConfig:
    """Runtime LoRA: `max_loras` adapter slots of rank <= `max_rank`; `modules`: (name, PEFT folder) loaded at
    start (any path the operator names); `allow_runtime`: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    are served (off: 403), reading adapters only from inside the directory `root` (required with it, refused
    without it; `serve.lora_root`)."""

    max_loras: int = 4
    max_rank: int = 64
    modules: tuple[tuple[str, str], ...] = ()
    allow_runtime: bool = False
    root: str | None = None

    def __post_init__(self):
        if self.allow_runtime and not self.root:
            raise ValueError("LoraServeConfig: allow_runtime needs a root directory (--lora-root DIR): runtime "
                             "adapters are read only from inside it")
        if self.root and not self.allow_runtime:
            raise ValueError("LoraServeConfig: root is read only with allow_runtime (--allow-runtime-lora)")


SERVE_DECODE_STEPS = 8  # the server's multi-step default: faster decode than K = 1 at 1 and at 64 users
# (benchmarks/RESULTS.md#s3-multistep)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The HTTP server. model: HF folder, surojax output folder or .gguf file; tokenizer: a folder (None: the
    model's); dtype: "auto" (bfloat16 on GPU, float32 elsewhere), "float32" or "bfloat16"; attention: the
    attention backend (models/layers/attention_backend.py; its spelling is parsed here); max_queue: waiting requests beyond max_num_seqs before 429; max_request_bytes: the
    largest request body (413 beyond it); lora: None = no adapters. The engine's default decodes
    SERVE_DECODE_STEPS tokens per device call while no request waits (the library's EngineConfig: 1)."""

    model: str
    engine: EngineConfig = EngineConfig(scheduler=SchedulerConfig(decode_steps=SERVE_DECODE_STEPS))
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    # auto: cuDNN on a GPU (a 16 x 512 prefill call 25.9 ms against xla's 38.7, 1 x 8192 36 against 228; TTFT p50
    # at 64 users 107 ms against 158, H100, RESULTS.md session 27), xla elsewhere; "cudnn:8" etc. parsed here
    attention: AttentionBackend = AUTO_ATTENTION
    max_queue: int = 256
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    lora: LoraServeConfig | None = None
    log_level: str = "info"
    allow_remote_images: bool = False  # fetch http(s) image URLs of chat requests (serve/image_prompt.py)

    def __post_init__(self):
        object.__setattr__(self, "attention", as_attention_backend(self.attention, key="ServeConfig: attention"))
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"ServeConfig: dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if not 0 < self.port <= 65535:
            raise ValueError(f"ServeConfig: port must be in 1 .. 65535, got {self.port}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"ServeConfig: max_queue must be an integer >= 0, got {self.max_queue!r}")
        _positive("ServeConfig", max_request_bytes=self.max_request_bytes)
        if self.lora is not None and self.engine.speculative is not None \
                and self.engine.speculative.method is SpecMethod.MTP:
            raise ValueError("MTP speculation is not supported with LoRA adapters (--enable-lora): the checkpoint's "
                             "MTP head predicts the base model (use --speculative-method ngram or draft)")
        if self.lora is not None and self.engine.kv_cache_dtype is KVCacheDtype.FP8:
            raise ValueError("--kv-cache-dtype fp8 is not supported with LoRA adapters (--enable-lora): the FP8 "
                             "scales are bounded from the base weights, which an adapter changes")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model of a multi-model server (`MultiServeConfig`): its `ServeConfig` (source, served name, tokenizer,
    engine with its own KV budget, LoRA; its host / port / api_key / max_request_bytes / log_level are unused: the
    server's are `MultiServeConfig`'s) and sleep_after_idle_s: seconds without a request after which it sleeps
    (`serve.sleep`; None: never)."""

    serve: ServeConfig
    sleep_after_idle_s: float | None = None

    @property
    def name(self) -> str:
        return self.serve.served_model_name or self.serve.model

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.serve.lora.modules) if self.serve.lora is not None else ()

    def __post_init__(self):
        if self.sleep_after_idle_s is not None and not self.sleep_after_idle_s > 0:
            raise ValueError(f"{self.name}: sleep_after_idle_s must be > 0, got {self.sleep_after_idle_s}")


@dataclasses.dataclass(frozen=True)
class MultiServeConfig:
    """Several models behind one HTTP server (`serve.model_router`), each with its own engine (scheduler, KV
    pool), picked by the request's "model". enable_sleep_mode: POST /sleep, POST /wake_up and GET /is_sleeping
    are served (vLLM's names; off: 403) and models may sleep when idle (`ServedModel.sleep_after_idle_s`).
    Requests without "model" go to the first model. Model and adapter names must be unique across the server."""

    models: tuple[ServedModel, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_level: str = "info"
    enable_sleep_mode: bool = False

    def __post_init__(self):
        if not self.models:
            raise ValueError("MultiServeConfig: give at least one model")
        seen: dict[str, str] = {}
        for m in self.models:
            for name, what in ((m.name, "model"), *((a, f"LoRA adapter of {m.name}") for a in m.adapter_names)):
                if name in seen:
                    raise ValueError(f"the name {name!r} is used twice ({seen[name]} and {what}): requests pick a "
                                     "model or adapter by its name, so every name must be unique")
                seen[name] = what
            if m.sleep_after_idle_s is not None and not self.enable_sleep_mode:
                raise ValueError(f"{m.name}: sleep_after_idle_s needs enable_sleep_mode: true")
        if not 0 < self.port <= 65535:
            raise ValueError(f"MultiServeConfig: port must be in 1 .. 65535, got {self.port}")
        _positive("MultiServeConfig", max_request_bytes=self.max_request_bytes)


def default_max_model_len(max_position_embeddings: int | None) -> int:
    """max_model_len None: the model's limit, at most DEFAULT_MAX_MODEL_LEN_CAP (4096 where the model has none)."""
    return min(max_position_embeddings or 4096, DEFAULT_MAX_MODEL_LEN_CAP)


__all__ = ["DEFAULT_MAX_MODEL_LEN_CAP", "DEFAULT_MAX_REQUEST_BYTES", "EngineConfig", "KVCacheDtype", "KVPath", "LoraServeConfig",
           "MultiServeConfig", "RunnerBuckets", "ServedModel", "SchedulerConfig", "ServeConfig", "SpecMethod", "SpeculativeConfig",
           "default_max_model_len"]
