"""Which offload settings this build can run, checked before any data or weight is touched.

The cross-field rules that are about the config alone (offload_base_weights needs LoRA and recomputation) live
with the others in surojax/config/rules.py; this module says what is implemented and whether the backend
has host memory to offload to.
"""
from __future__ import annotations

from surojax.offload.host_memory import raise_host_memory_limit
from surojax.offload.streaming import OffloadError, host_memory_kind

OFFLOAD_AVAILABLE: tuple[str, ...] = ("offload_base_weights", "offload_optimizer",
                                       "offload_master")  # the keys the memory plan may suggest
NOT_YET = {
    "offload_grads": "gradients in host memory are not available yet",
}


def check_offload_settings(cfg) -> None:
    """OffloadError for an offload key that cannot run here (not implemented, or no host memory kind)."""
    for key, why in NOT_YET.items():
        if getattr(cfg, key, False) and key not in OFFLOAD_AVAILABLE:
            raise OffloadError(f"{key}: {why}")
    if any(getattr(cfg, k, False) for k in OFFLOAD_AVAILABLE) or getattr(cfg, "recompute", None) == "offload":
        raise_host_memory_limit()  # before the first device query creates the GPU client
        host_memory_kind()
