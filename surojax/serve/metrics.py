"""Prometheus metrics of the server, written in the text exposition format (version 0.0.4) by hand.

Counters and histograms are updated by the engine thread and rendered by the HTTP thread under one lock;
gauges (queue depth, KV usage, prefix-cache counters) are read from the engine when /metrics is scraped.
"""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        cum += self.counts[-1]
        out += [f'{name}_bucket{{le="+Inf"}} {cum}', f"{name}_sum {self.sum}", f"{name}_count {cum}"]
        return out


class ServeMetrics:
    PREFIX = "surojax"

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rejected = 0  # 429
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def finished(self, reason: str, e2e_s: float) -> None:
        with self.lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.e2e.observe(e2e_s)

    def render(self, engine) -> str:
        p = self.PREFIX
        kv = engine.kv
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {p}_{name} {help_}")
            lines.append(f"# TYPE {p}_{name} {kind}")
            lines.extend(samples)

        def scalar(name: str, kind: str, help_: str, value) -> None:  # one unlabelled sample
            metric(name, kind, help_, [f"{p}_{name} {value}"])

        with self.lock:
            reasons = dict(self.requests) or {"stop": 0}
            metric("requests_total", "counter", "Finished requests by finish reason.",
                   [f'{p}_requests_total{{finish_reason="{r}"}} {n}' for r, n in sorted(reasons.items())])
            scalar("requests_rejected_total", "counter", "Requests refused because the queue was full (429).",
                   self.rejected)
            scalar("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", self.prompt_tokens)
            scalar("generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens)
            metric("time_to_first_token_seconds", "histogram", "Time from arrival to the first token.",
                   self.ttft.lines(f"{p}_time_to_first_token_seconds"))
            metric("inter_token_latency_seconds", "histogram", "Time between two tokens of one request.",
                   self.itl.lines(f"{p}_inter_token_latency_seconds"))
            metric("e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
                   self.e2e.lines(f"{p}_e2e_request_latency_seconds"))
        scalar("num_requests_running", "gauge", "Requests in the running batch.", engine.num_running)
        scalar("num_requests_waiting", "gauge", "Requests waiting for admission (queue depth).", engine.num_waiting)
        scalar("kv_cache_usage_ratio", "gauge", "Fraction of KV blocks held by live requests.", kv.usage)
        scalar("kv_cache_free_blocks", "gauge", "Free KV blocks (cached-but-free blocks count as free).",
               kv.num_free_blocks)
        scalar("kv_cache_blocks", "gauge", "KV blocks in the pool.", kv.num_blocks)
        scalar("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               kv.prefix_cache_queries)
        scalar("prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.",
               kv.prefix_cache_hits)
        scalar("num_preemptions_total", "counter", "Requests preempted (recomputed later).",
               engine.scheduler.num_preemptions)
        spec = engine.spec_stats
        if spec is not None:  # speculative decoding (serve.speculative.SpecStats)
            scalar("spec_decode_proposed_tokens_total", "counter", "Tokens proposed by speculation.", spec.proposed)
            scalar("spec_decode_accepted_tokens_total", "counter", "Proposed tokens the target accepted.",
                   spec.accepted)
            scalar("spec_decode_verify_steps_total", "counter", "Sequences verified (one per sequence per step).",
                   spec.row_steps)
            scalar("spec_decode_acceptance_rate", "gauge", "Accepted / proposed tokens.", spec.acceptance_rate)
            scalar("spec_decode_mean_accepted_length", "gauge", "Accepted proposals per sequence per verify step.",
                   spec.mean_accepted_length)
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value: for tests and the load generator."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
