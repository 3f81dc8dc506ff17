"""The `fp8_hybrid` recipe as a transform on a built `Decoder`: the decoder's Linear targets multiply in FP8 (q, k,
v, o, gate, up, down; a hybrid's Gated DeltaNet in_proj_qkv / in_proj_z / out_proj; a shared expert's three; the
targets and the ones kept bf16 are linear_swap.py's). Embeddings, norms, attention, the DeltaNet's recurrence, MoE
experts and the LM head / chunked cross-entropy stay in bf16.

    apply_fp8(model, frozen_base=True)     # LoRA: after apply_lora / init_lora; the base is quantised once
    apply_fp8(model, frozen_base=False)    # full fine-tuning: the weights are quantised at every use

What changes: each targeted base `Linear` (the `base` of a LoRALinear) is replaced by an `Fp8Linear` with the
same `kernel` / `bias` variables under the same names, so state paths, checkpoints and exports do not move.
Its `__call__` runs `fp8_matmul.fp8_dot` (trainable weight) or `fp8_dot_frozen` (frozen base). With
`frozen_base` the kernel's value becomes an `Fp8Weight` (E4M3 values [L, K, N] + one dequantisation factor per
layer [L], each layer scaled by its own amax), which halves the base's memory and reads; the variable stays a
plain `nnx.Param`, so LoRA's filters keep it frozen. LoRA's A / B path is untouched (bf16 compute).

Scaling (`Fp8Settings.scaling`, config key fp8_scaling): current (per tensor, its own amax), delayed (per tensor,
an amax history carried by the training step: fp8_delayed.py) or blockwise (1x128 / 128x128 tiles, emulated:
fp8_blockwise.py).

Layers kept in bf16 (`skip_quant_first_layers` / `skip_quant_last_layers`, HF layer indices on a hybrid too): the
stacked layers share one scan body, so each Fp8Linear of a stack with bf16 rows holds a per-row flag ([rows] bool,
`linear_swap.QuantLayerMask`) and picks the FP8 or the bf16 matmul with `lax.cond`; the kernel then stays in bf16
(quantised per step) so the skipped layers keep it exact.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear, dot
from surojax.models.layers.params import AXES
from surojax.precision import fp8_delayed
from surojax.precision.fp8_blockwise import Fp8BlockWeight, fp8_dot_blockwise, fp8_dot_blockwise_frozen
from surojax.precision.fp8_delayed import Fp8AmaxHistory, Fp8AmaxProbe, Fp8Scale, fp8_dot_delayed, \
    fp8_dot_delayed_cached, fp8_dot_frozen_delayed, quantize_weight_delayed
from surojax.precision.fp8_matmul import fp8_dot, fp8_dot_cached, fp8_dot_frozen, quantize_weight
from surojax.precision.fp8_scaling import E4M3, Fp8Scaling, Fp8Settings, dequant_factor, quantize, scale_from_amax
from surojax.precision.linear_swap import QuantLayerMask, layer_mask, swap_base_linears, swapped_linears


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A frozen kernel quantised once: q [..., K, N] E4M3 and its dequantisation factor d [...] (per layer)."""
    q: jax.Array
    d: jax.Array

    @classmethod
    def quantize(cls, w: jax.Array, compute_dtype=jnp.bfloat16) -> "Fp8Weight":
        """w [L, K, N] (or [K, N]) -> per-layer (per-matrix) scaled E4M3."""
        amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(-2, -1))  # [L]
        d = dequant_factor(scale_from_amax(amax, 448.0), compute_dtype)
        return cls(quantize(w, d[..., None, None], E4M3), d)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.q.astype(dtype) * self.d.astype(dtype)[..., None, None]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8CachedWeight:
    """This step's E4M3 copies of a trainable kernel: q [..., K, N], qt [..., N, K], d [...] (per layer); amax
    [...] the weight's amax for delayed scaling's probe (None with current scaling)."""
    q: jax.Array
    qt: jax.Array
    d: jax.Array
    amax: jax.Array | None = None


class Fp8WeightCache(nnx.Variable):
    """An Fp8Linear's `Fp8CachedWeight` for the step under way (set by `Fp8WeightCaching.attach`, never saved)."""


def _gemm_current(x, w, c, delayed):
    return fp8_dot(x, w)


def _gemm_current_frozen(x, w, c, delayed):
    return fp8_dot_frozen(x, w.q, w.d)


def _gemm_current_cached(x, w, c, delayed):
    return fp8_dot_cached(x, w, c.q, c.qt, c.d)


def _gemm_delayed(x, w, c, delayed):
    return fp8_dot_delayed(x, w, *delayed)


def _gemm_delayed_frozen(x, w, c, delayed):
    return fp8_dot_frozen_delayed(x, w.q, w.d, *delayed)


def _gemm_delayed_cached(x, w, c, delayed):
    return fp8_dot_delayed_cached(x, w, c.q, c.qt, c.d, c.amax, *delayed)


def _gemm_blockwise(x, w, c, delayed):
    return fp8_dot_blockwise(x, w)


def _gemm_blockwise_frozen(x, w, c, delayed):
    return fp8_dot_blockwise_frozen(x, w.q, w.d)


# (scaling, the kernel's form) -> the GEMM: trainable (a plain array), frozen (quantised once at load: Fp8Weight,
# Fp8BlockWeight for blockwise) or cached (a trainable kernel quantised once this step: Fp8WeightCaching)
GEMMS = {
    (Fp8Scaling.CURRENT, "trainable"): _gemm_current,
    (Fp8Scaling.CURRENT, "frozen"): _gemm_current_frozen,
    (Fp8Scaling.CURRENT, "cached"): _gemm_current_cached,
    (Fp8Scaling.DELAYED, "trainable"): _gemm_delayed,
    (Fp8Scaling.DELAYED, "frozen"): _gemm_delayed_frozen,
    (Fp8Scaling.DELAYED, "cached"): _gemm_delayed_cached,
    (Fp8Scaling.BLOCKWISE, "trainable"): _gemm_blockwise,
    (Fp8Scaling.BLOCKWISE, "frozen"): _gemm_blockwise_frozen,
}
CACHED_SCALINGS = tuple(s for s, form in GEMMS if form == "cached")  # whose trainable kernels a step quantises once


class Fp8Linear(Linear):
    """A Linear whose matmul runs in FP8. Holds the original Linear's `kernel` and `bias` variables.

    scaling: an `Fp8Scaling`; DELAYED adds the variables fp8_scale [L, 3], fp8_history [L, 3, H] and fp8_probe
    [L, 3] (surojax/precision/fp8_delayed.py). The GEMM is looked up in `GEMMS` by the scaling and the kernel's
    form (trainable, frozen, cached this step)."""

    def __init__(self, linear: Linear, *, mask: QuantLayerMask | None = None,
                 scaling: Fp8Scaling = Fp8Scaling.CURRENT,
                 delayed_state: tuple[jax.Array, jax.Array, jax.Array] | None = None):
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = linear.kernel
        self.bias = linear.bias
        self.fp8_layers = mask
        self.scaling = Fp8Scaling(scaling)
        if self.scaling is Fp8Scaling.DELAYED:
            scale, history, probe = delayed_state
            setattr(self, fp8_delayed.SCALE, Fp8Scale(scale, **{AXES: ("layers", None)}))
            setattr(self, fp8_delayed.HISTORY, Fp8AmaxHistory(history, **{AXES: ("layers", None, None)}))
            setattr(self, fp8_delayed.PROBE, Fp8AmaxProbe(probe, **{AXES: ("layers", None)}))

    def _fp8(self, x, w, *delayed):
        cache = getattr(self, "fp8_cache", None)
        c = None if cache is None else cache.get_value()
        form = "cached" if c is not None else "frozen" if isinstance(w, (Fp8Weight, Fp8BlockWeight)) else "trainable"
        return GEMMS[self.scaling, form](x, w, c, delayed)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel.get_value()
        delayed = () if self.scaling is not Fp8Scaling.DELAYED else (self.fp8_scale.get_value(),
                                                                     self.fp8_probe.get_value())
        if self.fp8_layers is None:
            y = self._fp8(x, w, *delayed)
        else:
            y = jax.lax.cond(self.fp8_layers.get_value(), self._fp8, lambda x, w, *_: dot(x, w), x, w, *delayed)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


def _cacheable(model):
    """(site key, Fp8Linear) of the swapped layers whose kernel a step may quantise once: trainable (a plain
    array), current or delayed scaling."""
    for key, lin in swapped_linears(model, Fp8Linear).items():
        if lin.scaling in CACHED_SCALINGS and isinstance(lin.kernel.get_value(), jax.Array):
            yield key, lin


class Fp8WeightCaching:
    """fp8_hybrid full fine-tuning with current or delayed scaling: each trainable kernel is quantised to E4M3 (both
    layouts, per layer) ONCE per step instead of at every use (the forward and the recompute of every micro-batch).
    Delayed scaling quantises it with the step's W scale from the history (its own amax before any) and hands the
    probe the amax the cast observed, as fp8_dot_delayed does.

        cache = Fp8WeightCaching().build(model)     # in the step, before the micro-batches: {path: Fp8CachedWeight}
        Fp8WeightCaching().attach(model, cache)     # on each micro-batch's merged model, before its forward

    The GEMMs then read the copies (fp8_dot_cached: the same bits as fp8_dot) and the kernel only receives its
    gradient. Costs 2 bytes per kernel parameter of device memory for the step (the memory plan counts them);
    saves per use one fp32 amax read and one cast pass of each weight (benchmarks/RESULTS.md, session 13)."""

    def build(self, model) -> dict:
        dtype = model.dtype

        def current(w_l):
            return Fp8CachedWeight(*quantize_weight(jax.lax.stop_gradient(w_l), dtype))

        def delayed(xs):
            w_l, scale_l = xs
            return Fp8CachedWeight(*quantize_weight_delayed(jax.lax.stop_gradient(w_l), scale_l[1], dtype))

        # vmap over the layers, not lax.map: one batched cast kernel per kernel stack and no loop whose output
        # stacks XLA zero-fills and copies first (their cost: benchmarks/RESULTS.md, session 14)
        cache = {}
        for path, lin in _cacheable(model):
            w = lin.kernel.get_value()
            cache[path] = (jax.vmap(current)(w) if lin.scaling is Fp8Scaling.CURRENT else
                           jax.vmap(delayed)((w, jax.lax.stop_gradient(getattr(lin, fp8_delayed.SCALE)[...]))))
        return cache

    def attach(self, model, cache: dict) -> None:
        found = dict(_cacheable(model))
        if set(found) != set(cache):
            raise ValueError(f"FP8 weight cache: built for {sorted(cache)}, the model has {sorted(found)}")
        for path, lin in found.items():
            lin.fp8_cache = Fp8WeightCache(cache[path])


def fp8_layer_mask(num_layers: int, skip_first: int, skip_last: int) -> jax.Array | None:
    """[L] bool (False on the first / last skipped layers), or None when every layer runs in FP8."""
    return layer_mask(num_layers, skip_first, skip_last, "FP8")


def apply_fp8(model, *, frozen_base: bool, skip_first: int = 0, skip_last: int = 0,
              compute_dtype=jnp.bfloat16, settings: Fp8Settings = Fp8Settings()) -> list[str]:
    """Swap the base Linear of every target `linear_swap.quantised_sites` names for an Fp8Linear (in place);
    returns the site keys swapped.

    frozen_base: the kernels are frozen (LoRA): quantise them once into `Fp8Weight`s (per layer; `Fp8BlockWeight`
    128 x 128 blocks with settings.scaling blockwise), unless some of the stack's layers are kept in bf16, which
    need the bf16 values. skip_first / skip_last: HF layers kept in bf16. settings.scaling delayed: each Fp8Linear
    gets its delayed-scaling state (fp8_delayed.init_state). Raises ValueError for a kernel that is already
    quantised (qlora_* bases)."""
    blockwise = settings.scaling is Fp8Scaling.BLOCKWISE

    def make(key: str, lin: Linear, rows: int, mask: QuantLayerMask | None) -> Fp8Linear:
        if frozen_base and mask is None:
            value = lin.kernel.get_value()
            frozen = Fp8BlockWeight.quantize(value) if blockwise else Fp8Weight.quantize(value, compute_dtype)
            lin.kernel = nnx.Param(frozen, **lin.kernel.get_metadata())
        state = None
        if settings.scaling is Fp8Scaling.DELAYED:
            state = fp8_delayed.init_state(rows, settings.amax_history)
        return Fp8Linear(lin, mask=mask, scaling=settings.scaling, delayed_state=state)

    return swap_base_linears(model, make, "fp8_hybrid", skip_first=skip_first, skip_last=skip_last,
                             precision="FP8")


__all__ = ["Fp8Weight", "Fp8CachedWeight", "Fp8WeightCache", "Fp8WeightCaching", "Fp8Linear", "apply_fp8",
           "fp8_layer_mask"]
