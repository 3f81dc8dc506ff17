"""Whether this backend can hold what a run puts in host memory, checked before any data or weight is touched.

Which offload keys exist and how they combine is the config check's business (surojax/config/rules.py); this
module raises the GPU client's pinned-host cap and checks that the backend has a host memory kind.
"""
from __future__ import annotations

from surojax.offload.host_memory import raise_host_memory_limit
from surojax.offload.streaming import host_memory_kind

OFFLOAD_AVAILABLE: tuple[str, ...] = ("offload_base_weights", "offload_optimizer",
                                       "offload_master")  # the keys the memory plan may suggest


def prepare_host_memory(uses_host_memory: bool) -> None:
    """OffloadError when the run keeps something in host memory and the backend has no host memory kind."""
    if uses_host_memory:
        raise_host_memory_limit()  # before the first device query creates the GPU client
        host_memory_kind()
