"""How much pinned host memory the GPU client may hand out (XLA's host allocator is capped at 64 GB by default).

XLA's GPU client allocates `pinned_host` arrays from its own pool, capped by ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``
(default 64). Qwen3-32B's bf16 base alone is 61 GiB, the fp32 AdamW moments of an 8B model 61 GiB: past the cap
the first large ``device_put`` fails with RESOURCE_EXHAUSTED. So, when host offloading is configured and the user
has not set the variable, raise the cap to 90% of the machine's RAM. The variable is read once, when the GPU
client is created (the first ``jax.devices()``), so this must run before anything touches a device; after that
it only logs that it came too late.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_GB = 64
FRACTION_OF_RAM = 0.9


def total_ram_gb(meminfo: str = "/proc/meminfo") -> int | None:
    """The machine's RAM in GB (10^9 bytes), or None where /proc/meminfo is not readable."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 // 10**9
    except OSError:
        return None
    return None


def limit_for(ram_gb: int) -> int:
    """The cap surojax asks for on a machine with this much RAM: 90% of it, never below XLA's default."""
    return max(XLA_DEFAULT_GB, int(ram_gb * FRACTION_OF_RAM))


def _backends_initialized() -> bool:
    try:  # lazy: this module imports no jax (it runs before the GPU client exists)
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a jax without the private module: assume the worst
        return True
    return bool(getattr(xla_bridge, "_backends", {}))


def raise_host_memory_limit(ram_gb: int | None = None) -> int | None:
    """Set ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` to 90% of RAM unless the user set it. -> the limit now in the
    environment (None when RAM is unknown and nothing was set). Never lowers it below XLA's default."""
    if os.environ.get(ENV):
        return int(float(os.environ[ENV]))
    ram_gb = total_ram_gb() if ram_gb is None else ram_gb
    if ram_gb is None:
        return None
    limit = limit_for(ram_gb)
    os.environ[ENV] = str(limit)
    if _backends_initialized():
        log.warning("%s=%d set after the GPU client was created: it applies to the next process only "
                    "(export it before starting to use more than %d GB of pinned host memory)", ENV, limit,
                    XLA_DEFAULT_GB)
    else:
        log.info("host offloading: %s=%d (90%% of %d GB RAM; XLA's default is %d)", ENV, limit, ram_gb,
                 XLA_DEFAULT_GB)
    return limit
