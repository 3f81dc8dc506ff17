"""Router monitoring of a MoE run: the step's router stats -> scalar metrics, a progress-line part, and a
warning when an expert starves.

The train step returns the layers' `RouterStats` summed over its micro-batches (expert_counts / prob_sums
[L, E], the rest [L]). `RouterMonitor.observe` turns them into metrics.jsonl keys:

    router_aux_loss        load-balancing loss of the step's whole batch (surojax.losses.router; with one
                           micro-batch exactly the one trained on: with several, each micro-batch trains on its own)
    router_z_loss          router z-loss (mean logsumexp^2 over tokens, averaged over layers)
    router_entropy         mean entropy of the router distribution per token and layer (nats; ln E = uniform)
    router_load_max/_min   over layers, the largest / smallest share of a layer's assignments one expert got,
                           relative to the fair share 1/E (1.0 = even; min 0 = an idle expert)
    router_load_max_l{l}, router_load_min_l{l}   the same for each layer l
    router_dropped         assignments past an expert's capacity (only with `capacity_factor`)

Starvation: counts accumulate over a window of `window` steps; at its end each layer's experts that got less than
`STARVING_SHARE` of their fair share are named in ONE warning (not one per step), and the window restarts.
"""
from __future__ import annotations

import logging

import numpy as np

from surojax.models.layers.moe import RouterStats

log = logging.getLogger(__name__)
STARVING_SHARE = 0.1  # an expert with < 10% of its fair share of a window's assignments starves
STARVATION_WINDOW = 50  # steps per starvation check
_NAMED = 5  # (layer, expert) pairs a warning names


class RouterMonitor:
    def __init__(self, *, capacity: bool, window: int = STARVATION_WINDOW):
        self.capacity = capacity
        self.window = window
        self.window_counts: np.ndarray | None = None  # [L, E] assignments since the window began
        self.window_start = 0

    def observe(self, step: int, stats: RouterStats) -> dict[str, float]:
        """The metrics of step `step` (1-based) from its summed stats; warns at the end of a starvation window."""
        counts = np.asarray(stats.expert_counts, np.float64)  # [L, E]
        L, E = counts.shape
        tokens = np.asarray(stats.tokens, np.float64)  # [L]
        n = max(tokens.sum(), 1.0)
        probs = np.asarray(stats.prob_sums, np.float64).sum(0)
        share = counts * E / np.maximum(counts.sum(-1, keepdims=True), 1.0)  # [L, E] load / fair share
        m = {
            "router_aux_loss": float(E * np.sum(counts.sum(0) / n * probs / n)),
            "router_z_loss": float(np.mean(np.asarray(stats.z_sum, np.float64) / np.maximum(tokens, 1.0))),
            "router_entropy": float(np.asarray(stats.entropy_sum, np.float64).sum() / n),
            "router_load_max": float(share.max()),
            "router_load_min": float(share.min()),
        }
        for layer in range(L):
            m[f"router_load_max_l{layer}"] = float(share[layer].max())
            m[f"router_load_min_l{layer}"] = float(share[layer].min())
        if self.capacity:
            m["router_dropped"] = float(np.asarray(stats.dropped).sum())
        self._watch_starvation(step, counts)
        return m

    def _watch_starvation(self, step: int, counts: np.ndarray) -> None:
        if self.window_counts is None:
            self.window_counts, self.window_start = np.zeros_like(counts), step
        self.window_counts += counts
        if step - self.window_start + 1 < self.window:
            return
        c = self.window_counts
        share = c * c.shape[1] / np.maximum(c.sum(-1, keepdims=True), 1.0)  # [L, E]
        layers, experts = np.nonzero(share < STARVING_SHARE)
        if len(layers):
            named = ", ".join(f"layer {l} expert {e} ({share[l, e]:.2f}x)" for l, e in
                              zip(layers[:_NAMED], experts[:_NAMED]))
            more = f" and {len(layers) - _NAMED} more" if len(layers) > _NAMED else ""
            log.warning("router: %d expert(s) starve over steps %d-%d (< %d%% of their fair share of the "
                        "assignments): %s%s", len(layers), self.window_start, step, round(100 * STARVING_SHARE),
                        named, more)
        self.window_counts = None


def progress_text(m: dict[str, float]) -> str:
    """The router part of the progress line, e.g. `aux 0.012 load max/min 1.8x` (+ `dropped 12`)."""
    lo, hi = m["router_load_min"], m["router_load_max"]
    ratio = f"{hi / lo:.1f}x" if lo > 0 else "inf (an idle expert)"
    text = f"aux {m['router_aux_loss']:.3g} load max/min {ratio}"
    if "router_dropped" in m:
        text += f" dropped {m['router_dropped']:,.0f}"
    return text
