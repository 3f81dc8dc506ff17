"""The FP8 transform (recipe fp8_hybrid): what `build_run` applies and plugs into the training step.

    Fp8Transform(settings, frozen_base=..., skip_first=..., skip_last=..., compute_dtype=...)
      apply      `apply_fp8`: the decoder's Linear layers become Fp8Linear (fp8_transform.py)
      trainable  delayed scaling: the amax probes, scales and histories ride in the trainable state (the step's
                 `StepState` splits them off before the optimizer); None otherwise
      hooks      `fp8_step_hooks`: delayed scaling's `DelayedScalingUpdate` (state) and `DelayedScalingStep`
                 (compile: the first and the steady program, fp8_delayed.py); full fine-tuning with current or
                 delayed scaling the weight cache (`Fp8WeightCaching`: build before the step, attach before each
                 micro-batch)
      memory     fp8_weight_cache: the cache's E4M3 copies of the kernels (plan_memory)

Everything that depends on `Fp8Settings.scaling` outside the GEMMs is decided here, from the typed `Fp8Scaling`.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.transform import StepHooks
from surojax.precision.fp8_delayed import DelayedScalingStep, DelayedScalingUpdate, Fp8AmaxProbe, Fp8DelayedState
from surojax.precision.fp8_matmul import dot_form
from surojax.precision.fp8_scaling import Fp8Scaling, Fp8Settings
from surojax.precision.fp8_transform import CACHED_SCALINGS, Fp8WeightCaching, apply_fp8
from surojax.precision.linear_swap import kept_bf16_sites

log = logging.getLogger(__name__)


def fp8_step_hooks(delayed: DelayedScalingUpdate | None, caching: Fp8WeightCaching | None) -> StepHooks | None:
    """The training step's FP8 hooks: delayed scaling's state and two programs, and the per-step weight cache."""
    if delayed is None and caching is None:
        return None
    return StepHooks(
        state=delayed,
        before_step=None if caching is None else caching.build,
        before_micro=None if caching is None else (lambda model, key, cache: caching.attach(model, cache)),
        compile=None if delayed is None else (lambda step, donated: DelayedScalingStep(step, delayed, donated)))


class Fp8Transform:
    """recipe fp8_hybrid as a Transform (surojax.models.transform; module docstring)."""

    name = "fp8"
    freezes_base = False

    def __init__(self, settings: Fp8Settings, *, frozen_base: bool, skip_first: int | None = 0,
                 skip_last: int | None = 0, compute_dtype=jnp.bfloat16):
        """skip_first / skip_last: decoder layers kept in bf16 (None: none)."""
        self.settings, self.frozen_base = settings, frozen_base
        self.skip_first, self.skip_last, self.compute_dtype = skip_first or 0, skip_last or 0, compute_dtype
        self.delayed = settings.scaling is Fp8Scaling.DELAYED
        self.caches = not frozen_base and settings.scaling in CACHED_SCALINGS  # full fine-tuning: cache per step
        self.targets: list[str] | None = None

    def apply(self, model: nnx.Module) -> None:
        """Raises ValueError for a kernel that is already quantised (qlora_* bases)."""
        try:
            self.targets = apply_fp8(model, frozen_base=self.frozen_base, skip_first=self.skip_first,
                                     skip_last=self.skip_last, compute_dtype=self.compute_dtype,
                                     settings=self.settings)
        except ValueError as e:
            raise ValueError(f"recipe: fp8_hybrid: {e}") from None
        log.info("fp8_hybrid: %s", self.summary())
        if kept := kept_bf16_sites(model, self.targets):
            log.info("fp8_hybrid: linear targets kept bf16: %s (docs/precision.md)", ", ".join(kept))
        if not has_fp8_tensor_cores():
            _warn_no_fp8(jax.devices()[0].device_kind)

    @property
    def trainable(self):
        return nnx.Any(Fp8AmaxProbe, Fp8DelayedState) if self.delayed else None

    @property
    def hooks(self) -> StepHooks | None:
        return fp8_step_hooks(DelayedScalingUpdate(algo=self.settings.amax_compute_algo) if self.delayed else None,
                              Fp8WeightCaching() if self.caches else None)

    @property
    def memory(self) -> dict:
        return {"fp8_weight_cache": True} if self.caches else {}

    def summary(self) -> str:
        n = "" if self.targets is None else f"{len(self.targets)} "
        return (f"{n}linear targets multiply in FP8 ({'frozen E4M3' if self.frozen_base else 'trainable'} base, "
                f"{self.settings.scaling} scaling, {dot_form()} GEMMs: SUROJAX_FP8_DOT"
                f"{', weights quantised once per step' if self.caches else ''})")


@functools.lru_cache(maxsize=None)  # once per device kind (a model may be built twice: shapes, then values)
def _warn_no_fp8(kind: str) -> None:
    log.warning("fp8_hybrid: %s has no FP8 tensor cores (needs compute capability >= 8.9, e.g. H100 / H200): the "
                "GEMMs run in bf16 after the FP8 rounding, slower than recipe: bf16", kind)


def has_fp8_tensor_cores() -> bool:
    """Whether the default device runs FP8 GEMMs (NVIDIA Ada / Hopper or newer)."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cc is not None and tuple(int(v) for v in str(cc).split(".")[:2]) >= (8, 9)
    except ValueError:
        return False


__all__ = ["Fp8Transform", "fp8_step_hooks", "has_fp8_tensor_cores"]
