"""How long a refused client should wait: the `Retry-After` of a 429 (queue full) or 503 (draining / dead).

A refused request finds room once the requests in front of it have moved on. The engine frees a place each time
a request finishes, so the wait is estimated as

    retry_after = ceil(ahead / finish_rate),   finish_rate = requests finished / busy seconds over recent steps

where `ahead` is the queue length (429: the waiting requests, so that the whole crowd refused with it finds the
queue drained when it comes back; 503: everything in flight) and the rate comes from the engine's recent steps
(`FinishRate`, the last `WINDOW_S` seconds of steps). With no finish in the window the rate is bounded above by
one per busy time so far; with no step at all the estimate is `MIN_S`. The result is clamped to
[`MIN_S`, `MAX_S`] whole seconds (Retry-After takes integer seconds).
"""
from __future__ import annotations

import collections
import math
import threading
import time

WINDOW_S = 30.0
MIN_S = 1
MAX_S = 60


class FinishRate:
    """Recent engine steps (end time, seconds, requests finished); written by the engine thread, read by the
    HTTP side under a lock."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._steps: collections.deque[tuple[float, float, int]] = collections.deque()
        self._lock = threading.Lock()

    def record(self, step_s: float, finished: int) -> None:
        now = self._clock()
        with self._lock:
            self._steps.append((now, step_s, finished))
            while self._steps and self._steps[0][0] < now - self.window_s:
                self._steps.popleft()

    def per_second(self) -> float | None:
        """Requests finished per busy second over the window (None: no step in it)."""
        now = self._clock()
        with self._lock:
            steps = [s for s in self._steps if s[0] >= now - self.window_s]
        busy = sum(s[1] for s in steps)
        if not steps or busy <= 0:
            return None
        return max(sum(s[2] for s in steps), 1) / busy  # no finish yet: at most one per busy time so far


def retry_after_s(ahead: int, finish_rate: float | None) -> int:
    """Whole seconds for `ahead` requests to finish at `finish_rate` per second, in [MIN_S, MAX_S]."""
    if finish_rate is None or ahead <= 0:
        return MIN_S
    return int(min(max(math.ceil(ahead / finish_rate), MIN_S), MAX_S))


__all__ = ["FinishRate", "MAX_S", "MIN_S", "WINDOW_S", "retry_after_s"]
