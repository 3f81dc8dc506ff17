"""Delayed FP8 scaling (`fp8_scaling: delayed`): each quantised tensor is scaled from an amax history of the
previous steps, so its quantisation does not wait for a reduction over the tensor itself.

Per Fp8Linear and per layer of the scanned stack, three tensors are scaled: index 0 = x, 1 = W, 2 = dy (ROLES).
Their state lives in the model as three variables, stacked on the layer axis like the kernel:

    fp8_scale    Fp8Scale        [L, 3] fp32   s used by this step (q = saturate(rne(t * s))); 0: none yet,
                                               the tensor's own amax is used (current scaling) for that step
    fp8_history  Fp8AmaxHistory  [L, 3, H] fp32 amaxes of the last H steps, newest first
    fp8_probe    Fp8AmaxProbe    [L, 3] fp32   always 0: its *gradient* is the amaxes observed this pass

How the amaxes leave the scanned layer stack: the GEMM's custom_vjp takes the probe as an input and returns the
amaxes of x, W (computed in the forward, kept as residuals) and dy (computed in the backward) as the probe's
cotangent. The decoder's lax.scan stacks the cotangents of its per-layer inputs, so `value_and_grad` of the loss
hands back [L, 3] observed amaxes per Linear with no change to model code (flax's fp8_ops return the new scale /
history as the "gradient" of their meta variables, OVERWRITE_WITH_GRADIENT; here only the observation leaves the
model and the update rule runs in the step, so micro-batches combine by max, not by the sum gradients get). The
amax is a reduction over the logical (global) tensor, so under GSPMD data parallelism it is the max over the
devices. A probe read by more than one pass per step (pipeline microbatches) would sum: refused by the config check.

The step's side of it (the FP8 transform's step hooks, fp8_recipe.py, plugged into surojax/train/step.py):
`DelayedScalingUpdate` is the hooks' `StepState` (surojax.models.transform): split these variables off the
trainable state, combine the micro-batches' observations (max), and roll them into the history after the step
(fp8_scaling.roll_amax_history). The scale used at step t comes from the history of steps < t only.
`DelayedScalingStep` is the hooks' `compile`: the step as two programs, the first step's and the steady one's.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.precision.fp8_matmul import _NN, _NT, _flat, _scaled_dot
from surojax.precision.fp8_scaling import (E4M3, E5M2, amax, current_factor, dequant_factor, quantize,
                                           quantize_both, roll_amax_history, spec)

ROLES = ("x", "w", "dy")
FORMATS = (E4M3, E4M3, E5M2)  # of x, W, dy
FORMAT_MAX = tuple(spec(f).max for f in FORMATS)  # 448, 448, 57344


class Fp8DelayedState(nnx.Variable):
    """Delayed-scaling state the step overwrites after each step (never the optimizer's)."""


class Fp8Scale(Fp8DelayedState):
    """[L, 3] fp32: the scales s of (x, W, dy) this step."""


class Fp8AmaxHistory(Fp8DelayedState):
    """[L, 3, H] fp32: the amaxes of the last H steps, newest first."""


class Fp8AmaxProbe(nnx.Variable):
    """[L, 3] fp32 zeros; the gradient of the loss with respect to it is the amaxes (x, W, dy) this pass saw."""


# ---- the GEMMs ------------------------------------------------------------------------------------------------

# How the GEMMs traced here find each tensor's factor; read at trace time (`scale_source`, set by the training step)
SOURCES = ("either", "own", "history")
_SOURCE = contextvars.ContextVar("fp8_delayed_scale_source", default="either")


@contextlib.contextmanager
def scale_source(source: str):
    """Trace the delayed GEMMs inside with this way of picking each tensor's dequantisation factor:

    either   (default) 1 / s from the history, or the tensor's own amax where none was observed yet (s == 0): one
             lax.cond per tensor, which XLA GPU runs by copying the predicate to the host and waiting for the
             stream (ConditionalThunk): a pipeline drain per tensor and layer
    own      every tensor by its own amax (current scaling): the first step of a run, before any history
    history  1 / s, and 1 where s == 0 (Transformer Engine's starting scale): no reduction over the tensor before
             it is quantised and no host round trip; the steps after the first

    The training step (make_train_step) compiles `own` and `history` and picks one per step on the host; both give
    what `either` gives whenever every tensor has a scale (history) or none has (own)."""
    if source not in SOURCES:
        raise ValueError(f"scale source {source!r}: expected one of {', '.join(SOURCES)}")
    token = _SOURCE.set(source)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def _factor(t: jax.Array, s: jax.Array, role: int, dtype) -> jax.Array:
    """The dequantisation factor of tensor t from its scale s in the history (0: none yet), as `scale_source`
    says."""
    source = _SOURCE.get()
    if source == "own":
        return current_factor(t, FORMATS[role], dtype)
    if source == "history":
        return dequant_factor(jnp.where(s > 0, s, 1.0), dtype)
    return jax.lax.cond(s > 0, lambda: dequant_factor(s, dtype),
                        lambda: current_factor(t, FORMATS[role], dtype))


@jax.custom_vjp
def fp8_dot_delayed(x: jax.Array, w: jax.Array, scale: jax.Array, probe: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype; x and W E4M3, dy E5M2, each scaled by `scale` [3] (not by
    its own amax). The cotangent of `probe` [3] is (amax x, amax W, amax dy); `scale` gets none."""
    return _delayed_fwd(x, w, scale, probe)[0]


def _delayed_fwd(x, w, scale, probe):
    del probe
    dtype, x2 = x.dtype, _flat(x)
    d = jnp.stack([_factor(x2, scale[0], 0, dtype), _factor(w, scale[1], 1, dtype)])  # [2]: x, W (dy: backward)
    # both layouts and the amax in one pass per tensor (fp8_matmul's fp8_dot says which GEMM reads which)
    x_q, x_qt, amax_x = quantize_both(x2, d[0], E4M3)
    w_q, w_qt, amax_w = quantize_both(w, d[1], E4M3)
    y = _scaled_dot(x_q, d[0], w_qt, d[1], _NT, dtype, forward=True)
    res = (x_qt, w_q, d, scale[2], amax_x, amax_w, jnp.zeros((), w.dtype))
    return y.reshape(*x.shape[:-1], w.shape[-1]), res


def _delayed_bwd(res, g):
    x_qt, w_q, d, scale_g, amax_x, amax_w, w_dtype = res
    dtype, g2 = g.dtype, _flat(g)
    d_g = _factor(g2, scale_g, 2, dtype)
    g_q, g_qt, amax_g = quantize_both(g2, d_g, E5M2)
    dx = _scaled_dot(g_q, d_g, w_q, d[1], _NT, dtype)
    dw = _scaled_dot(x_qt, d[0], g_qt, d_g, _NT, dtype)
    observed = jnp.stack([amax_x, amax_w, amax_g])
    return (dx.reshape(*g.shape[:-1], w_q.shape[0]), dw.astype(w_dtype.dtype), jnp.zeros((3,), jnp.float32),
            observed)


fp8_dot_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def quantize_weight_delayed(w: jax.Array, scale_w: jax.Array, compute_dtype):
    """(w_q, w_qt, w_d, amax_w): what `fp8_dot_delayed` makes of w at every use, for `fp8_dot_delayed_cached`
    (fp8_transform's per-step weight cache: the same bits)."""
    d = _factor(w, scale_w, 1, compute_dtype)
    w_q, w_qt, amax_w = quantize_both(w, d, E4M3)
    return w_q, w_qt, d, amax_w


@jax.custom_vjp
def fp8_dot_delayed_cached(x, w, w_q, w_qt, w_d, amax_w, scale, probe):
    """`fp8_dot_delayed(x, w, scale, probe)` with w's E4M3 copies (and the amax the probe reports) made once per
    step by `quantize_weight_delayed`; w itself only receives the weight gradient."""
    return _delayed_cached_fwd(x, w, w_q, w_qt, w_d, amax_w, scale, probe)[0]


def _delayed_cached_fwd(x, w, w_q, w_qt, w_d, amax_w, scale, probe):
    del probe
    dtype, x2 = x.dtype, _flat(x)
    d_x = _factor(x2, scale[0], 0, dtype)
    x_q, x_qt, amax_x = quantize_both(x2, d_x, E4M3)
    y = _scaled_dot(x_q, d_x, w_qt, w_d, _NT, dtype, forward=True)
    res = (x_qt, w_q, jnp.stack([d_x, w_d]), scale[2], amax_x, amax_w, jnp.zeros((), w.dtype))
    return y.reshape(*x.shape[:-1], w_qt.shape[0]), res


def _delayed_cached_bwd(res, g):
    dx, dw, d_scale, observed = _delayed_bwd(res, g)
    return dx, dw, None, None, None, None, d_scale, observed


fp8_dot_delayed_cached.defvjp(_delayed_cached_fwd, _delayed_cached_bwd)


@jax.custom_vjp
def fp8_dot_frozen_delayed(x, w_q, w_d, scale, probe):
    """x [..., K] @ (w_q [K, N] E4M3 * w_d) with x and dy scaled by `scale` [3] (the W entry is unused: a frozen
    base is quantised once at load by its own amax). Probe cotangent: (amax x, 0, amax dy)."""
    return _frozen_delayed_fwd(x, w_q, w_d, scale, probe)[0]


def _frozen_delayed_fwd(x, w_q, w_d, scale, probe):
    del probe
    dtype, x2 = x.dtype, _flat(x)
    d_x = _factor(x2, scale[0], 0, dtype)
    y = _scaled_dot(quantize(x2, d_x, E4M3), d_x, w_q, w_d, _NN, dtype, forward=True)
    return y.reshape(*x.shape[:-1], w_q.shape[-1]), (w_q, w_d, scale[2], amax(x2))


def _frozen_delayed_bwd(res, g):
    w_q, w_d, scale_g, amax_x = res
    g2 = _flat(g)
    d_g = _factor(g2, scale_g, 2, g.dtype)
    dx = _scaled_dot(quantize(g2, d_g, E5M2), d_g, w_q, w_d, _NT, g.dtype)
    observed = jnp.stack([amax_x, jnp.zeros((), jnp.float32), amax(g2)])
    return (dx.reshape(*g.shape[:-1], w_q.shape[0]), jnp.zeros_like(w_q), jnp.zeros_like(w_d),
            jnp.zeros((3,), jnp.float32), observed)


fp8_dot_frozen_delayed.defvjp(_frozen_delayed_fwd, _frozen_delayed_bwd)


# ---- the step's side ------------------------------------------------------------------------------------------

SCALE, HISTORY, PROBE = "fp8_scale", "fp8_history", "fp8_probe"  # the variables' attribute names on Fp8Linear


@dataclasses.dataclass(frozen=True)
class DelayedScalingUpdate:
    """What the training step does with the delayed-scaling variables of a model's trainable state (a
    surojax.models.transform.StepState: the probes are its observers, the scales and histories what it carries).

    split(trainable) -> (params, probes, delayed)   params: what the optimizer updates
    combine(a, b) -> the observations of two micro-batches (elementwise max)
    update(delayed, observed) -> delayed            the step's amaxes rolled into every history, new scales
    merge(params, probes, delayed) -> trainable
    fresh(trainable) -> bool                        no history yet: trace the step under scale_source("own"),
                                                    else scale_source("history")
    histories(trainable) -> [arrays]
    """
    algo: str = "max"
    margin: int = 0

    @staticmethod
    def split(trainable: nnx.State) -> tuple[nnx.State, nnx.State, nnx.State]:
        probes, delayed, params = nnx.split_state(trainable, Fp8AmaxProbe, Fp8DelayedState, ...)
        return params, probes, delayed

    @staticmethod
    def merge(params: nnx.State, probes: nnx.State, delayed: nnx.State) -> nnx.State:
        return nnx.merge_state(params, probes, delayed)

    @staticmethod
    def combine(a, b):
        return jax.tree.map(jnp.maximum, a, b)

    scale_source = staticmethod(scale_source)  # the step traces its two programs under it

    @staticmethod
    def histories(trainable: nnx.State) -> list[jax.Array]:
        """The amax history arrays of a trainable state."""
        return [v.get_value() if isinstance(v, nnx.Variable) else v
                for _, v in nnx.to_flat_state(nnx.filter_state(trainable, Fp8AmaxHistory))]

    @classmethod
    def fresh(cls, trainable: nnx.State) -> bool:
        """True when no amax history holds anything yet (a run's first step): the step then scales by the tensors'
        own amaxes (`scale_source("own")`), after that by the histories' scales. One small reduction read back on
        the host (the histories are replicated: every process decides alike)."""
        histories = cls.histories(trainable)
        if not histories:
            return False
        return not bool(np.asarray(_any_nonzero(histories).addressable_data(0)))

    def update(self, delayed: nnx.State, observed: nnx.State) -> nnx.State:
        """observed: the probes' gradients (same paths as the probes), each [L, 3]."""
        seen = {path[:-1]: var for path, var in nnx.to_flat_state(observed) if path[-1] == PROBE}
        flat = dict(nnx.to_flat_state(delayed))
        fp8_max = jnp.asarray(FORMAT_MAX, jnp.float32)
        for path, var in list(flat.items()):
            if path[-1] != HISTORY:
                continue
            owner = path[:-1]
            scale_var = flat[owner + (SCALE,)]
            new_amax = jnp.asarray(seen[owner].get_value() if isinstance(seen[owner], nnx.Variable) else seen[owner])
            history, scale = roll_amax_history(var.get_value(), scale_var.get_value(), new_amax, fp8_max, self.algo,
                                               self.margin)
            flat[path] = var.replace(history)
            flat[owner + (SCALE,)] = scale_var.replace(scale)
        return nnx.from_flat_state(list(flat.items()))


@jax.jit
def _any_nonzero(arrays: list) -> jax.Array:
    return jnp.any(jnp.stack([jnp.any(a != 0) for a in arrays]))


class DelayedScalingStep:
    """The step of fp8_scaling: delayed as two compiled programs, picked on the host: the first step of a run (no
    amax history yet) scales each tensor by its own amax, every later one by its history's scale
    (`scale_source` "own" / "history"). One program with a lax.cond per tensor would do both, but XLA GPU
    runs a conditional by reading its predicate back to the host and waiting for the stream: a pipeline drain per
    tensor, layer and micro-batch. Whether the histories are still empty is read from the input (one small
    reduction read back) unless the input is what the history program itself returned last (then they are filled:
    the steady state costs no read); a resumed run starts on the history program.

    Called like the jitted step; `.lower(*args)` lowers the program those arguments would run (the history one for
    abstract arguments). `steady` is the program a run settles on, `compiles_next` whether the last call ran the
    first-step program (the next compiles the steady one): the trainer and the bench read them through
    surojax.train.step.steady_state / compiles_steady_next."""

    def __init__(self, step: Callable, update: DelayedScalingUpdate, donated: tuple[int, ...]):
        self.step = step  # the plain function (traced alone: one lax.cond per tensor, scale_source "either")
        self._fp8 = update

        def under(source):
            @functools.wraps(step)  # the compiled module keeps the step's name (jit_step: profiles, HLO dumps)
            def traced(*args, **kwargs):
                with scale_source(source):
                    return step(*args, **kwargs)
            return jax.jit(traced, donate_argnums=donated)

        self.first, self.later = under("own"), under("history")
        self.last = None  # the program the last call ran
        self._returned = []  # the histories the history program returned last: filled

    @property
    def steady(self):
        """The history program (its first step starts every scale at 1, Transformer Engine's start)."""
        return self.later

    @property
    def compiles_next(self) -> bool:
        return self.last is self.first

    def program(self, trainable):
        """The compiled step these arguments run (`first` or `later`)."""
        leaves = jax.tree.leaves(trainable)
        if any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves):
            return self.later  # abstract (lowering for a memory or HLO check): the steady-state program
        histories = self._fp8.histories(trainable)
        if self._returned and len(histories) == len(self._returned) and all(
                a is b for a, b in zip(histories, self._returned)):
            return self.later
        return self.first if self._fp8.fresh(trainable) else self.later

    def __call__(self, trainable, *args, **kwargs):
        program = self.last = self.program(trainable)
        out = program(trainable, *args, **kwargs)
        self._returned = self._fp8.histories(out[0]) if program is self.later else []
        return out

    def lower(self, trainable, *args, **kwargs):
        return self.program(trainable).lower(trainable, *args, **kwargs)


def init_state(num_layers: int, history: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(scale [L, 3] zeros, history [L, 3, H] zeros, probe [L, 3] zeros): the state before the first step.
    A scale of 0 means "no amax seen yet": in a run's first step (every history empty) each tensor is scaled by its
    own amax (current scaling; Transformer Engine starts from scale 1, which flushes a first-step dy of ~1e-6 to
    zero in E5M2), in later steps a tensor still without one by 1 (`scale_source`)."""
    if history < 1:
        raise ValueError(f"fp8_amax_history must be >= 1, got {history}")
    return (jnp.zeros((num_layers, 3), jnp.float32), jnp.zeros((num_layers, 3, history), jnp.float32),
            jnp.zeros((num_layers, 3), jnp.float32))


__all__ = ["ROLES", "FORMAT_MAX", "SOURCES", "scale_source", "Fp8DelayedState", "Fp8Scale", "Fp8AmaxHistory",
           "Fp8AmaxProbe", "fp8_dot_delayed", "fp8_dot_delayed_cached", "quantize_weight_delayed",
           "fp8_dot_frozen_delayed", "DelayedScalingUpdate", "DelayedScalingStep", "init_state"]
