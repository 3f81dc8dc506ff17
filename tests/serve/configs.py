"""Test helper: an `EngineConfig` from flat keyword arguments (the tests' tiny pools and buckets)."""
from __future__ import annotations

import dataclasses

from surojax.serve.config import EngineConfig, RunnerBuckets, SchedulerConfig

_SCHEDULER = {f.name for f in dataclasses.fields(SchedulerConfig)}
BUCKETS = RunnerBuckets(min_rows=4, min_prefill_rows=4, min_context=64, min_prefill=16)  # few CPU compilations


def engine_config(**kw) -> EngineConfig:
    """SchedulerConfig's fields go to `scheduler`, the others to EngineConfig itself (an unknown name raises)."""
    sched = {k: kw.pop(k) for k in list(kw) if k in _SCHEDULER}
    return EngineConfig(scheduler=SchedulerConfig(**sched), **kw)
