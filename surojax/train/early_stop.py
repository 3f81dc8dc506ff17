"""Training phases and the early-stop rules (`early_stop`).

Phase (always computed; `PHASES`). The last 100 finite training losses are kept; for the first 50 the phase is
`warmup`. After that the window (51 ... 100 losses) is split into an older and a recent half (the recent half takes
the odd one) and
- `unstable`   if the recent half's coefficient of variation (std / |mean|) is above 15 %, else, with the relative
               improvement `(mean_older - mean_recent) / |mean_older|`,
- `converging` if the improvement is above 0.1 %,
- `diverging`  if it is below -1 %,
- `plateau`    in between (-1 % ... 0.1 %).
The CV is taken over the recent half only, so a curve that falls fast is not called unstable for its slope.
The thresholds assume the 50-step mean of the loss is stable to better than 0.1 % on a flat curve; a noisier loss
flickers between `plateau` and `converging`.

Stop rules (only with `early_stop`; the first that fires gives the reason, and the reason stays):
- `diverging`: the phase has been `diverging` for 200 consecutive finite steps;
- `plateau`: the phase has been `plateau` for 500 consecutive finite steps (the 500th stops);
- `flop_efficiency`: the loss reduction per FLOP fell under 50 % of its peak. It is measured every 50 finite steps
  once the window is full, as `(mean_older - mean_recent) / (flops_per_token * tokens of the recent half)`, the
  loss the last 50 steps bought per FLOP (FLOPs per token = 6 N). The peak is the largest value measured while the
  phase was `converging`, so noise on a flat or rising curve sets no peak; any later measurement under half the
  peak stops. This is the rule as Surogate states it, and it is strict: on a power-law curve L - L_inf ~ t^-a the
  rate falls as t^-(1+a), so it fires at 2^(1/(1+a)) (1.6 ... 1.9) times the step of the peak, which for a usual
  LM loss curve is the first measurement: such a run stops a few hundred steps in.
- `convergence` (from `observe_eval`): the convergence score of the eval losses is above 0.85 for 5 consecutive
  evals. score = 0.6 * stability + 0.4 * improvement, with
  stability   = clip(1 - CV of the last 5 eval losses, 0, 1),
  improvement = clip(1 - r / 0.05, 0, 1), r the relative improvement over the previous eval
                ((prev - cur) / |prev|); so this term is 1 when the eval loss no longer improves (or got worse)
                and 0 when it improved by 5 % or more. The first eval has no previous one and is not scored.
Non-finite losses (training or eval) are ignored: they enter no window and leave the counters as they are.
The phase and convergence rules are relative to the loss level: they are meant for positive losses (cross-entropy,
DPO); a loss that hovers around zero (policy-gradient objectives) reads as `unstable` and never stops them.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PHASES = ("warmup", "converging", "plateau", "diverging", "unstable")
_EPS = 1e-12


@dataclass(frozen=True)
class EarlyStopRules:
    window: int = 100
    warmup: int = 50
    converging_above: float = 0.001
    diverging_below: float = -0.01
    unstable_cv: float = 0.15
    diverging_steps: int = 200
    plateau_steps: int = 500
    efficiency_fraction: float = 0.5
    convergence_threshold: float = 0.85
    convergence_evals: int = 5
    stability_weight: float = 0.6
    """The improvement term weighs 1 - stability_weight."""
    eval_window: int = 5
    improvement_saturates_at: float = 0.05


def classify_phase(losses: Sequence[float], rules: EarlyStopRules) -> str:
    """Phase of the window `losses` (oldest first, at most `rules.window` finite values)."""
    if len(losses) <= rules.warmup:
        return "warmup"
    x = np.asarray(losses, dtype=np.float64)
    older, recent = x[: len(x) // 2], x[len(x) // 2:]
    if float(recent.std()) / max(abs(float(recent.mean())), _EPS) > rules.unstable_cv:
        return "unstable"
    improvement = relative_improvement(older, recent)
    if improvement > rules.converging_above:
        return "converging"
    if improvement < rules.diverging_below:
        return "diverging"
    return "plateau"


def relative_improvement(older: np.ndarray, recent: np.ndarray) -> float:
    mean_older = float(older.mean())
    return (mean_older - float(recent.mean())) / max(abs(mean_older), _EPS)


def convergence_score(eval_losses: Sequence[float], rules: EarlyStopRules) -> float | None:
    """Score in [0, 1] of the eval-loss history (oldest first); None for fewer than two evals."""
    if len(eval_losses) < 2:
        return None
    window = np.asarray(eval_losses[-rules.eval_window:], dtype=np.float64)
    stability = min(max(1.0 - float(window.std()) / max(abs(float(window.mean())), _EPS), 0.0), 1.0)
    prev, cur = eval_losses[-2], eval_losses[-1]
    r = (prev - cur) / max(abs(prev), _EPS)
    improvement = min(max(1.0 - r / rules.improvement_saturates_at, 0.0), 1.0)
    return rules.stability_weight * stability + (1.0 - rules.stability_weight) * improvement


class EarlyStop:
    """Keeps the loss window, the phase and the stop counters. With `enabled` False it only tracks the phase."""

    def __init__(self, rules: EarlyStopRules, *, flops_per_token: float, enabled: bool):
        if enabled and not flops_per_token > 0:
            raise ValueError(f"early_stop needs flops_per_token > 0 (6 x parameters), got {flops_per_token}")
        self.rules, self.flops_per_token, self.enabled = rules, float(flops_per_token), enabled
        self.window: deque[tuple[float, int]] = deque(maxlen=rules.window)  # (loss, tokens) of finite steps
        self.finite_steps = 0
        self.phase = "warmup"
        self.plateau_run = 0
        self.diverging_run = 0
        self.peak_efficiency: float | None = None
        self.eval_losses: list[float] = []
        self.converged_evals = 0
        self.stop: str | None = None

    def observe(self, step: int, loss: float, tokens: int) -> tuple[str, ...]:
        """Feed one training step; returns the log lines. Read `phase` and `stop` afterwards."""
        if not math.isfinite(loss):
            return ()
        self.window.append((float(loss), int(tokens)))
        self.finite_steps += 1
        before, self.phase = self.phase, classify_phase([loss for loss, _ in self.window], self.rules)
        if not self.enabled or self.stop is not None:
            return ()
        events = [f"step {step}: phase {before} -> {self.phase}"] if self.phase != before else []
        self.plateau_run = self.plateau_run + 1 if self.phase == "plateau" else 0
        self.diverging_run = self.diverging_run + 1 if self.phase == "diverging" else 0
        r = self.rules
        if self.diverging_run >= r.diverging_steps:
            self.stop = "diverging"
            events.append(f"step {step}: early stop: diverging for {r.diverging_steps} steps")
        elif self.plateau_run >= r.plateau_steps:
            self.stop = "plateau"
            events.append(f"step {step}: early stop: plateau for {r.plateau_steps} steps")
        else:
            events.extend(self._check_efficiency(step))
        return tuple(events)

    def _check_efficiency(self, step: int) -> list[str]:
        r = self.rules
        half = r.window // 2
        if len(self.window) < r.window or self.finite_steps % half:
            return []
        losses = np.asarray([loss for loss, _ in self.window], dtype=np.float64)
        flops = self.flops_per_token * sum(t for _, t in list(self.window)[-half:])
        if flops <= 0:
            return []
        rate = float(losses[:-half].mean() - losses[-half:].mean()) / flops
        if self.peak_efficiency is not None and rate < r.efficiency_fraction * self.peak_efficiency:
            self.stop = "flop_efficiency"
            return [f"step {step}: early stop: loss reduction per FLOP {rate:.3g} < {r.efficiency_fraction:g} x "
                    f"peak {self.peak_efficiency:.3g}"]
        if self.phase == "converging" and rate > (self.peak_efficiency or 0.0):
            self.peak_efficiency = rate
        return []

    def observe_eval(self, step: int, eval_loss: float) -> tuple[str, ...]:
        if not self.enabled or self.stop is not None or not math.isfinite(eval_loss):
            return ()
        r = self.rules
        self.eval_losses = (self.eval_losses + [float(eval_loss)])[-max(r.eval_window, 2):]
        score = convergence_score(self.eval_losses, r)
        self.converged_evals = self.converged_evals + 1 if score is not None and score > r.convergence_threshold else 0
        if self.converged_evals < r.convergence_evals:
            return ()
        self.stop = "convergence"
        return (f"step {step}: early stop: convergence score {score:.3f} > {r.convergence_threshold:g} for "
                f"{r.convergence_evals} evals",)

    def state_dict(self) -> dict:
        return {"window": [list(w) for w in self.window], "finite_steps": self.finite_steps, "phase": self.phase,
                "plateau_run": self.plateau_run, "diverging_run": self.diverging_run,
                "peak_efficiency": self.peak_efficiency, "eval_losses": list(self.eval_losses),
                "converged_evals": self.converged_evals, "stop": self.stop}

    def load_state_dict(self, d: dict) -> None:
        self.window = deque(((float(loss), int(tokens)) for loss, tokens in d["window"]),
                             maxlen=self.rules.window)
        self.finite_steps = int(d["finite_steps"])
        self.phase = d["phase"]
        self.plateau_run, self.diverging_run = int(d["plateau_run"]), int(d["diverging_run"])
        self.peak_efficiency = d["peak_efficiency"]
        self.eval_losses = [float(x) for x in d["eval_losses"]]
        self.converged_evals = int(d["converged_evals"])
        self.stop = d["stop"]
