"""The `nvfp4` recipe as a transform on a built `Decoder`: the decoder's Linear targets (q, k, v, o, gate, up, down;
a hybrid's Gated DeltaNet in_proj_qkv / in_proj_z / out_proj; a shared expert's three; the targets and the ones
kept bf16 are linear_swap.py's) run the NVFP4 GEMMs of nvfp4_matmul (Fprop, Dgrad, Wgrad). Embeddings, norms,
attention and the LM head / chunked cross-entropy stay bf16, as in the paper, and so do the layers kept in bf16
(`bf16_layers`: HF layer indices, on a hybrid across both stacks).

    apply_nvfp4(model, frozen_base=False, seed=run_seed)   full fine-tuning / pretraining: W quantised every use
    apply_nvfp4(model, frozen_base=True, seed=run_seed)    LoRA: the base quantised once (16x16 tiles) at load
    set_rounding_keys(model, key)                          in the training step, before each micro-batch's forward
    Nvfp4Transform(frozen_base=..., seed=...)              the recipe as a run's transform (its step hook sets the
                                                           rounding keys)

Each swapped Linear keeps the original `kernel` / `bias` variables under their names (state paths, checkpoints and
exports do not move) and holds
    rounding_key  `Nvfp4RoundingKey` [rows, key]: the stochastic-rounding draws of its gradient quantisers, one key
                  per layer on the scanned axis (the decoder's scan drops what its body writes, so a self-advancing rng
                  cannot live in the layer: the step sets fresh keys, as for LoRA dropout)
    signs         the RHT's 16 random signs, fixed for the run (from `seed`)
    mask          `QuantLayerMask` [rows] where some of the stack's layers stay bf16 (shared with fp8_hybrid:
                  linear_swap.py)

With `frozen_base` the kernel's value becomes an `Nvfp4Tensor` (E2M1 values and E4M3 tile scales stored as
float8_e4m3fn, one fp32 global scale per layer): half the bf16 base's memory. Where layers are kept in bf16 the
kernel stays bf16 (quantised each step) so those layers keep it exact.
"""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear, dot
from surojax.models.layers.params import AXES
from surojax.models.targets import model_targets
from surojax.models.transform import StepHooks
from surojax.precision.hadamard import random_signs
from surojax.precision.linear_swap import QuantLayerMask, kept_bf16_sites, swap_base_linears, swapped_linears
from surojax.precision.nvfp4_matmul import nvfp4_dot, nvfp4_dot_frozen
from surojax.precision.nvfp4_quant import BLOCK, Nvfp4Tensor, quantize_16x16

log = logging.getLogger(__name__)

BF16_FRACTION = 0.15  # of the decoder layers kept in bf16 by default (the paper: ~15-16 %, most at the end)


def bf16_layers(num_layers: int, first: int | None = None, last: int | None = None) -> tuple[int, int]:
    """The (first, last) decoder layers kept in bf16: `first` / `last` where given, else the default rule for that
    end: ceil(15 %) of the layers, at least one and never all, split 1 : 4 between the start and the end as in
    the paper's 12B run (2 first + 8 last of 62 blocks)."""
    n = min(max(1, math.ceil(BF16_FRACTION * num_layers)), num_layers - 1)
    return (n // 5 if first is None else first), (n - n // 5 if last is None else last)


class Nvfp4RoundingKey(nnx.Variable):
    """Raw PRNG key data [L, *key_shape]: the stochastic-rounding draws of one Linear (set by set_rounding_keys)."""


class Nvfp4Linear(Linear):
    """A Linear whose three GEMMs run the NVFP4 recipe. Holds the original Linear's `kernel` and `bias` variables."""

    def __init__(self, linear: Linear, *, signs: tuple[int, ...], rounding_key: Nvfp4RoundingKey,
                 mask: QuantLayerMask | None = None):
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = linear.kernel
        self.bias = linear.bias
        self.signs = tuple(signs)
        self.rounding_key = rounding_key
        self.nvfp4_layers = mask

    def _nvfp4(self, x, w, key):
        if isinstance(w, Nvfp4Tensor):
            return nvfp4_dot_frozen(x, w, key)
        return nvfp4_dot(x, w, key, self.signs)

    def __call__(self, x: jax.Array) -> jax.Array:
        w, key = self.kernel.get_value(), self.rounding_key.get_value()
        if self.nvfp4_layers is None:
            y = self._nvfp4(x, w, key)
        else:
            y = jax.lax.cond(self.nvfp4_layers.get_value(), self._nvfp4, lambda x, w, _: dot(x, w), x, w, key)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


def _layer_keys(key: jax.Array, index: int, num_layers: int) -> jax.Array:
    return jax.random.key_data(jax.random.split(jax.random.fold_in(key, index), num_layers))  # [L, *key_shape]


def apply_nvfp4(model, *, frozen_base: bool, seed: int = 0, skip_first: int | None = None,
                skip_last: int | None = None) -> list[str]:
    """Swap the base Linear of every target `linear_swap.quantised_sites` names for an Nvfp4Linear (in place);
    returns the site keys swapped.

    skip_first / skip_last: HF decoder layers kept in bf16 (None: `bf16_layers`' rule for that end). seed: the RHT
    signs and the initial rounding keys. Raises ValueError for a kernel already quantised (qlora_* bases), a
    Linear already swapped, or in / out features that are not multiples of 16."""
    first, last = bf16_layers(model.cfg.num_layers, skip_first, skip_last)
    signs = random_signs(seed)
    base_key = jax.random.key(seed)
    index = iter(range(len(model_targets(model))))

    def make(key: str, lin: Linear, rows: int, mask: QuantLayerMask | None) -> Nvfp4Linear:
        for what, dim in (("in", lin.in_features), ("out", lin.out_features)):
            if dim % BLOCK:
                raise ValueError(f"{key}: {what}_features {dim} is not a multiple of {BLOCK} (NVFP4 blocks)")
        if frozen_base and mask is None:
            w_q = quantize_16x16(lin.kernel.get_value()).compact()  # [L, K, N] values, [L, K/16, N/16] scales
            lin.kernel = nnx.Param(w_q, **lin.kernel.get_metadata())
        rounding = Nvfp4RoundingKey(_layer_keys(base_key, next(index), rows), **{AXES: ("layers", None)})
        return Nvfp4Linear(lin, signs=signs, rounding_key=rounding, mask=mask)

    return swap_base_linears(model, make, "nvfp4", skip_first=first, skip_last=last, precision="NVFP4")


def nvfp4_linears(model) -> dict[str, Nvfp4Linear]:
    """site key -> its Nvfp4Linear (empty when the recipe is not applied)."""
    return swapped_linears(model, Nvfp4Linear)


def set_rounding_keys(model, key: jax.Array) -> None:
    """Give every Nvfp4Linear fresh stochastic-rounding keys derived from `key` (distinct per module and layer).
    Call it inside the training step once per micro-batch, before the forward pass. A no-op without the recipe."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    for i, mod in enumerate(nvfp4_linears(model).values()):
        mod.rounding_key.set_value(_layer_keys(key, i, mod.rounding_key.get_value().shape[0]))


class Nvfp4Transform:
    """recipe nvfp4 as a Transform (surojax.models.transform): `apply_nvfp4`, the RHT signs and first rounding
    keys from the run's seed; before each micro-batch fresh stochastic-rounding keys (`set_rounding_keys`, from
    a stream independent of LoRA dropout's: the step's key folded with 1). Nothing new trains; no memory term."""

    name = "nvfp4"
    freezes_base = False
    trainable = None
    memory: dict = {}

    def __init__(self, *, frozen_base: bool, seed: int = 0, skip_first: int | None = None,
                 skip_last: int | None = None):
        self.frozen_base, self.seed, self.skip_first, self.skip_last = frozen_base, seed, skip_first, skip_last
        self.targets: list[str] | None = None
        self.num_layers: int | None = None

    def apply(self, model) -> None:
        try:
            self.targets = apply_nvfp4(model, frozen_base=self.frozen_base, seed=self.seed,
                                       skip_first=self.skip_first, skip_last=self.skip_last)
        except ValueError as e:
            raise ValueError(f"recipe: nvfp4: {e}") from None
        self.num_layers = model.cfg.num_layers
        log.info("nvfp4: %s", self.summary())
        if kept := kept_bf16_sites(model, self.targets):
            log.info("nvfp4: linear targets kept bf16: %s (docs/precision.md)", ", ".join(kept))

    @property
    def hooks(self) -> StepHooks:
        return StepHooks(before_micro=lambda model, key, _: set_rounding_keys(model, jax.random.fold_in(key, 1)))

    def summary(self) -> str | None:
        if self.targets is None:
            return None
        L = self.num_layers
        first, last = bf16_layers(L, self.skip_first, self.skip_last)
        return (f"{len(self.targets)} linear targets run NVFP4 GEMMs (emulated: bf16 GEMMs on exactly quantised "
                f"operands) in {L - first - last} of {L} layers; the first {first} and last {last} stay bf16")


__all__ = ["BF16_FRACTION", "Nvfp4Linear", "Nvfp4RoundingKey", "Nvfp4Transform", "apply_nvfp4", "bf16_layers",
           "nvfp4_linears", "set_rounding_keys"]
