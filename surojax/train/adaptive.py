"""Surogate's adaptive training rules as one pure, checkpointable object, fed one step at a time.

Three switches (surojax/config/optim.py):
- `auto_lr_reduction`: the loss guard (surojax/train/loss_guard.py): NaN / inf steps are skipped, loss spikes and
  exploding gradients cut the learning rate (first temporarily, then permanently, at most 5 times);
- `early_stop`: stop on sustained divergence or plateau, on a collapsed loss reduction per FLOP, or on a converged
  eval loss (surojax/train/early_stop.py, which also defines the training phases);
- `epoch_adjustment`: the number of epochs from the Chinchilla budget, 20 tokens per parameter
  (`epochs_for_budget`).

The trainer calls, after each optimizer step `step` (its loss, global gradient norm before clipping, and the tokens
it processed over all replicas and micro-steps: they price the step's FLOPs),

    decision = adaptive.observe(step, loss, grad_norm, tokens)

and after each evaluation `adaptive.observe_eval(step, eval_loss)`. The `Decision` says what to do: multiply the
scheduled learning rate of the NEXT step by `lr_scale`; `skip_update` means this step's gradient was non-finite and
must not be applied; `stop` is the reason to end training (or None); `events` are log lines; `phase` is the
current training phase (always computed, even with every switch off, as information).

The decision comes after the step has run, so the step itself must leave a non-finite update unapplied (a finite
check inside the jitted step); `skip_update` reports it and counts it as an anomaly. Reading a step's loss and grad
norm forces a host sync; reading step t's values after dispatching step t + 1 avoids the stall, at the price of the
scale applying one step later than intended.

With every switch off the object changes nothing: `lr_scale` is 1.0, `skip_update` False, `stop` None, no events.
`state_dict()` / `load_state_dict()` carry everything the rules remember as JSON-serialisable values, so a resumed
run makes the same decisions as an uninterrupted one. A switch turned on at resume starts its rule fresh.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from surojax.config.optim import OptimSection
from surojax.train.early_stop import EarlyStop, EarlyStopRules
from surojax.train.loss_guard import LossGuard, LossGuardRules

TOKENS_PER_PARAM = 20
"""Chinchilla's compute-optimal ratio of training tokens to parameters."""
MAX_BUDGET_EPOCHS = 50
"""Upper bound of `epochs_for_budget` (Surogate's bound too): fine-tuning a large model on a small data set would
otherwise ask for thousands of epochs."""
STATE_VERSION = 1


@dataclass(frozen=True)
class AdaptiveSettings:
    auto_lr_reduction: bool = False
    early_stop: bool = False
    epoch_adjustment: bool = False
    loss_guard: LossGuardRules = field(default_factory=LossGuardRules)
    stopping: EarlyStopRules = field(default_factory=EarlyStopRules)

    @classmethod
    def from_optim(cls, optim: OptimSection) -> AdaptiveSettings:
        return cls(auto_lr_reduction=optim.auto_lr_reduction, early_stop=optim.early_stop,
                   epoch_adjustment=optim.epoch_adjustment)


@dataclass(frozen=True)
class Decision:
    lr_scale: float
    """Multiplier of the scheduled learning rate for the next step."""
    skip_update: bool
    """The observed step's loss or gradient norm was non-finite: do not apply its update (loss guard only)."""
    stop: str | None
    """Why training should end: diverging | plateau | flop_efficiency | convergence; None to go on."""
    events: tuple[str, ...]
    phase: str
    """warmup | converging | plateau | diverging | unstable (surojax.train.early_stop.PHASES)."""


class AdaptiveTraining:
    def __init__(self, settings: AdaptiveSettings, *, flops_per_token: float):
        """`flops_per_token`: training FLOPs per token, 6 x the model's parameter count (`flops_per_token()`);
        needed (> 0) only with `early_stop`."""
        self.settings = settings
        self.guard = LossGuard(settings.loss_guard) if settings.auto_lr_reduction else None
        self.stopper = EarlyStop(settings.stopping, flops_per_token=flops_per_token, enabled=settings.early_stop)

    def observe(self, step: int, loss: float, grad_norm: float, tokens: int) -> Decision:
        skip_update, events = False, ()
        if self.guard is not None:
            outcome = self.guard.observe(step, loss, grad_norm)
            skip_update, events = outcome.skip_update, outcome.events
        events += self.stopper.observe(step, loss, tokens)
        return self._decision(step, skip_update, events)

    def observe_eval(self, step: int, eval_loss: float) -> Decision:
        return self._decision(step, False, self.stopper.observe_eval(step, eval_loss))

    def _decision(self, step: int, skip_update: bool, events: tuple[str, ...]) -> Decision:
        lr_scale = self.guard.lr_scale(step + 1) if self.guard is not None else 1.0
        return Decision(lr_scale=lr_scale, skip_update=skip_update, stop=self.stopper.stop, events=events,
                        phase=self.stopper.phase)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "loss_guard": None if self.guard is None else self.guard.state_dict(),
                "early_stop": self.stopper.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"adaptive training state version {d.get('version')!r}, expected {STATE_VERSION}")
        if self.guard is not None and d["loss_guard"] is not None:
            self.guard.load_state_dict(d["loss_guard"])
        self.stopper.load_state_dict(d["early_stop"])


def flops_per_token(num_params: int) -> float:
    """Training FLOPs per token: 2 N forward + 4 N backward (the 6 N rule, attention not counted)."""
    return 6.0 * num_params


def chinchilla_tokens(num_params: int) -> int:
    return TOKENS_PER_PARAM * num_params


def epochs_for_budget(num_params: int, dataset_tokens: int, *, max_epochs: int = MAX_BUDGET_EPOCHS) -> int:
    """ceil(20 N / dataset_tokens) clipped to [1, max_epochs]: the epochs that bring the run to the Chinchilla
    budget (N: the model's parameter count; exact integer arithmetic)."""
    if num_params <= 0 or dataset_tokens <= 0:
        raise ValueError(f"need num_params > 0 and dataset_tokens > 0, got {num_params} and {dataset_tokens}")
    return min(max(1, -(-chinchilla_tokens(num_params) // dataset_tokens)), max_epochs)


def budget_line(num_params: int, dataset_tokens: int) -> str:
    """The log line of the Chinchilla budget `epoch_adjustment` applies (without it the summary's plan line gives
    the budget beside the planned tokens)."""
    epochs = epochs_for_budget(num_params, dataset_tokens)
    uncapped = -(-chinchilla_tokens(num_params) // dataset_tokens)
    capped = f" (capped at {MAX_BUDGET_EPOCHS})" if uncapped > epochs else ""
    return (f"Chinchilla budget: {TOKENS_PER_PARAM} x {num_params:,} parameters = {chinchilla_tokens(num_params):,} "
            f"tokens; dataset {dataset_tokens:,} tokens -> {epochs} epochs{capped}")
