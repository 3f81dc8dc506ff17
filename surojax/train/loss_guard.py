"""The loss guard (`auto_lr_reduction`): cut the learning rate when a step looks like the start of a blow-up.

An anomaly is one of
- a non-finite loss or gradient norm (NaN / inf), detected from the first step on;
- a loss spike: `loss > mean + 3 sigma` and `loss - mean > 0.5`;
- an exploding gradient: `grad_norm > 10 x mean grad norm` or `grad_norm > 100`;
where mean and sigma (population standard deviation) are taken over the last 100 *normal* steps, i.e. finite steps
that were not anomalies themselves (an anomaly never enters its own baseline, nor any later one). The two statistical
rules start once 50 normal steps are in that window (the guard's warm-up).

The response (a precise reading of "temporary LR x 0.5 blended back over 50 steps; later anomalies permanent x 0.5
cuts, at most 5"):
- the first anomaly of the run that is acted on cuts the learning rate temporarily: the next step runs at
  x 0.5, and the factor rises linearly back to 1 over 50 steps (step `s + k` after a cut at step `s` runs at
  `0.5 + 0.5 (k - 1) / 50` for k = 1 ... 50, at x 1 from `s + 51` on);
- every later anomaly that is acted on halves the learning rate for the rest of the run (a permanent cut), at most
  5 permanent cuts; after the 5th, anomalies are logged and nothing more is cut;
- an anomaly within 50 steps of the last cut (the cool-down) is logged and not acted on, so one burst of trouble
  (a NaN storm, a spike that lasts a few steps) costs one cut, not five.
A step with a non-finite loss or gradient norm is always reported as `skip_update`: its gradient must not be applied.

The scale handed out (`lr_scale(next_step)`) is the product of the permanent cuts and the temporary factor; it
multiplies the scheduled learning rate, so the schedule's shape is kept.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LossGuardRules:
    window: int = 100
    """Normal steps the mean / sigma of the loss and the mean grad norm are taken over."""
    warmup: int = 50
    """Normal steps needed in the window before the spike and grad-norm rules act."""
    spike_sigmas: float = 3.0
    spike_min_delta: float = 0.5
    """A spike must also exceed the window's mean loss by this much (absolute, in loss units)."""
    grad_norm_relative: float = 10.0
    grad_norm_absolute: float = 100.0
    lr_factor: float = 0.5
    blend_steps: int = 50
    """Steps over which the temporary cut returns linearly to the scheduled learning rate."""
    cooldown_steps: int = 50
    """Anomalies fewer than this many steps after the last cut are not acted on."""
    max_permanent_cuts: int = 5


@dataclass(frozen=True)
class GuardOutcome:
    skip_update: bool
    events: tuple[str, ...]


class LossGuard:
    """Detects anomalies step by step and keeps the learning-rate multiplier they call for. State is plain Python
    (JSON-serialisable through `state_dict`)."""

    def __init__(self, rules: LossGuardRules):
        self.rules = rules
        self.history: deque[tuple[float, float]] = deque(maxlen=rules.window)  # (loss, grad_norm) of normal steps
        self.permanent_scale = 1.0
        self.permanent_cuts = 0
        self.temporary_cut_step: int | None = None
        self.last_cut_step: int | None = None

    def lr_scale(self, next_step: int) -> float:
        """Multiplier of the scheduled learning rate for `next_step`."""
        scale = self.permanent_scale
        if self.temporary_cut_step is not None:
            k = next_step - self.temporary_cut_step  # 1 on the step right after the cut
            if 1 <= k <= self.rules.blend_steps:
                f = self.rules.lr_factor
                scale *= f + (1.0 - f) * (k - 1) / self.rules.blend_steps
        return scale

    def observe(self, step: int, loss: float, grad_norm: float) -> GuardOutcome:
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        anomaly = self._anomaly(loss, grad_norm) if finite else f"non-finite loss {loss} / grad norm {grad_norm}"
        if anomaly is None:
            self.history.append((float(loss), float(grad_norm)))
            return GuardOutcome(skip_update=False, events=())
        return GuardOutcome(skip_update=not finite, events=(f"step {step}: {anomaly}: {self._respond(step)}",))

    def _anomaly(self, loss: float, grad_norm: float) -> str | None:
        r = self.rules
        if len(self.history) < r.warmup:
            return None
        window = np.asarray(self.history, dtype=np.float64)  # [window, 2]: loss, grad norm
        mean, sigma = float(window[:, 0].mean()), float(window[:, 0].std())
        mean_gnorm = float(window[:, 1].mean())
        if loss > mean + r.spike_sigmas * sigma and loss - mean > r.spike_min_delta:
            return f"loss spike {loss:.4g} > {mean:.4g} + {r.spike_sigmas:g} sigma ({sigma:.3g})"
        if grad_norm > r.grad_norm_relative * mean_gnorm:
            return f"grad norm {grad_norm:.4g} > {r.grad_norm_relative:g} x mean {mean_gnorm:.3g}"
        if grad_norm > r.grad_norm_absolute:
            return f"grad norm {grad_norm:.4g} > {r.grad_norm_absolute:g}"
        return None

    def _respond(self, step: int) -> str:
        r = self.rules
        if self.last_cut_step is not None and step - self.last_cut_step < r.cooldown_steps:
            return f"within {r.cooldown_steps} steps of the cut at step {self.last_cut_step}, no new cut"
        if self.temporary_cut_step is None:
            self.temporary_cut_step = self.last_cut_step = step
            return f"lr x {r.lr_factor:g} for {r.blend_steps} steps, blended back"
        if self.permanent_cuts >= r.max_permanent_cuts:
            return f"no further cut ({r.max_permanent_cuts} permanent cuts made)"
        self.permanent_scale *= r.lr_factor
        self.permanent_cuts += 1
        self.last_cut_step = step
        return (f"lr x {r.lr_factor:g} for the rest of the run (permanent cut {self.permanent_cuts}/"
                f"{r.max_permanent_cuts}, lr scale now {self.permanent_scale:g})")

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history], "permanent_scale": self.permanent_scale,
                "permanent_cuts": self.permanent_cuts, "temporary_cut_step": self.temporary_cut_step,
                "last_cut_step": self.last_cut_step}

    def load_state_dict(self, d: dict) -> None:
        self.history = deque((tuple(h) for h in d["history"]), maxlen=self.rules.window)
        self.permanent_scale = float(d["permanent_scale"])
        self.permanent_cuts = int(d["permanent_cuts"])
        self.temporary_cut_step = d["temporary_cut_step"]
        self.last_cut_step = d["last_cut_step"]
