"""Test helper: an `EngineConfig` from flat keyword arguments (the tests' tiny pools and buckets)."""
from __future__ import annotations

import dataclasses

from surojax.serve.config import EngineConfig, RunnerBuckets, SchedulerConfig

_SCHEDULER = {f.name for f in dataclasses.fields(SchedulerConfig)}
BUCKETS = RunnerBuckets(min_rows=4, min_prefill_rows=4, min_context=64, min_prefill=16)  # few CPU compilations
# the engine size the qwen3-fixture engine tests share: one pool shape + BUCKETS, so their compiled prefill / decode
# programs are shared across tests and modules (in process, and through the persistent compilation cache)
SMALL = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=96, buckets=BUCKETS)


def engine_config(**kw) -> EngineConfig:
    """SchedulerConfig's fields go to `scheduler`, the others to EngineConfig itself (an unknown name raises)."""
    sched = {k: kw.pop(k) for k in list(kw) if k in _SCHEDULER}
    return EngineConfig(scheduler=SchedulerConfig(**sched), **kw)
