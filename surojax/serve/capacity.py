"""How many KV blocks to allocate: from the device's free memory by default (GPU), a fixed size on CPU.

    bytes per token = sum over the pools (`kv_pools`: one per KV shape) of 2 (k, v) x L x K x H x itemsize(kv dtype)
                      (fp8: 1 byte, half of bf16: 2x the tokens; L: the pool's layers, the attention layers that
                      compute keys / values: Gemma 4's KV-shared layers count nothing)
    GPU:  free = memory_utilization x bytes_limit - bytes_in_use (weights already loaded); the pool gets
          ``kv_share`` of it, the rest is left for the step's workspace. The reference runner gathers each
          row's context into a per-row view (and the decoder writes an updated copy of it), so the
          workspace grows with the running contexts: half of the free memory is the default share.
    CPU:  ``CPU_KV_BYTES`` (no memory statistics), capped at ``CPU_MAX_TOKENS`` tokens.
At least one max_model_len sequence must fit, else the error says how much memory the pool would need.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from surojax.models.config import ModelConfig
from surojax.serve.config import KVCacheDtype
from surojax.serve.kv_fp8 import FP8_DTYPE, check_pool_dtype, is_fp8
from surojax.serve.kv_pools import kv_pools

CPU_KV_BYTES = 256 * 2**20
CPU_MAX_TOKENS = 65536


class KVCapacityError(ValueError):
    is_user_error = True


def kv_pool_dtype(choice: KVCacheDtype, model_dtype, explicit=None):
    """The pool's dtype: `explicit` when given (it must agree with `choice`: FP8 wants float8_e4m3fn), else
    AUTO -> the model's compute dtype, FP8 -> float8_e4m3fn."""
    if explicit is not None:
        check_pool_dtype(explicit)
        if (choice is KVCacheDtype.FP8) != is_fp8(explicit):
            raise ValueError(f"kv_cache_dtype {choice.value} contradicts the pool dtype {jnp.dtype(explicit)}")
        return explicit
    return FP8_DTYPE if choice is KVCacheDtype.FP8 else model_dtype


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype) -> int:
    """k and v of every pool layer for one token (`kv_pools`: a hybrid's linear-attention layers keep state slots
    instead, Gemma 4's KV-shared layers read another layer's rows, its full layers have their own shape)."""
    return sum(p.bytes_per_token(kv_dtype) for p in kv_pools(cfg))


def device_free_bytes(memory_utilization: float = 0.9, device=None, others_bytes_in_use: int = 0) -> int | None:
    """memory_utilization x the device's limit - what is in use (less others_bytes_in_use: memory of other models
    in the same server, outside this one's share), or None where the device has no statistics."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # CPU backends raise or return None
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(memory_utilization * stats["bytes_limit"]) - (int(stats.get("bytes_in_use", 0)) - others_bytes_in_use)


def num_kv_blocks(cfg: ModelConfig, kv_dtype, block_size: int, max_model_len: int, *,
                  memory_utilization: float = 0.9, kv_share: float = 0.5, device=None, reserved_bytes: int = 0,
                  others_bytes_in_use: int = 0) -> int:
    """reserved_bytes: device memory the engine allocates beside the pool (a hybrid model's state slots), taken
    from the free memory first (GPU); others_bytes_in_use: `device_free_bytes`'s."""
    per_block = kv_bytes_per_token(cfg, kv_dtype) * block_size
    free = device_free_bytes(memory_utilization, device, others_bytes_in_use)
    if free is None:
        blocks = min(CPU_KV_BYTES // per_block, CPU_MAX_TOKENS // block_size)
    else:
        blocks = int(max(free - reserved_bytes, 0) * kv_share) // per_block
    need = -(-max_model_len // block_size)
    if blocks < need:
        raise KVCapacityError(
            f"the KV cache would hold {blocks * block_size} tokens, fewer than --max-model-len {max_model_len} "
            f"({need * per_block / 2**30:.2f} GiB needed); lower --max-model-len, raise --gpu-memory-utilization, "
            "or give --num-kv-blocks")
    return max(blocks, need)
