"""FP8 number formats and per-tensor scaling for the `fp8_hybrid` recipe.

    E4M3 (float8_e4m3fn, max 448)    forward operands: activations and weights
    E5M2 (float8_e5m2,  max 57344)   backward operand: the output gradient dy

A tensor t is stored as q = saturate(round_to_nearest_even(t * s)) in the FP8 format and read back as q * d with
d = 1 / s (the dequantisation factor). The scale is Transformer Engine's rounded down to a power of two

    s = 2^floor(log2(fp8_max * 2^-margin / amax))   (amax = max |t|; the previous s is kept when amax is 0 or not
                                                     finite), so amax * s lies in (fp8_max / 2, fp8_max]

(Transformer Engine's `force_pow_2_scales`, torchao's `round_scales_to_power_of_2`; MXFP8's and DeepSeek-V3.1's
UE8M0 block scales are powers of two for the same reason). A power of two is exact in every float type, so s, d,
t * s and the GEMM's final multiply by d_a * d_b round nothing: the bits cannot depend on where a compiler keeps a
value in fp32 or bf16. With s = 448 / amax itself, d = 1 / s rounded to bf16 was the factor q * d was defined by,
and XLA GPU removes such f32 -> bf16 -> f32 round trips inside a program (SimplifyFPConversions under
xla_allow_excess_precision): the H200 quantised every operand with the exact fp32 s while the same code run op by op
used 1 / bf16(1 / s), a grid shifted by up to 2^-9 (benchmarks/RESULTS.md, session 14). The cost: amax uses the top
binade of the format only down to fp8_max / 2 (one binade less of headroom below, no precision lost above).

Two ways to pick amax:
    current scaling   amax of the tensor being quantised, in the same step (fp8_scaling: current;
                      surojax/precision/fp8_matmul.py)
    delayed scaling   max (or most recent) over a rolling history of the amaxes of the previous steps
                      (`roll_amax_history`; fp8_scaling: delayed, the config's default, fp8_delayed.py), so the
                      quantisation never waits for a reduction over the tensor it quantises

q * d is then the value the GEMM sees whether XLA folds d into the cuBLASLt scale (GPU) or multiplies it out (the
CPU reference), in one program or op by op.
`round_fp8_reference` is an independent pure-jnp model of the rounding (exponent / mantissa arithmetic, no FP8
dtype involved) that tests hold the dtype conversion against.
"""
from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_cast import cast_transpose
from surojax.kernel_settings import Fp8Cast, kernel_settings

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """An FP8 format as the rounding reference needs it."""
    dtype: object
    max: float  # largest finite value (saturation bound)
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal number


AMAX_ALGOS = ("max", "most_recent")  # fp8_amax_compute_algo (Transformer Engine's names)

SPECS = {
    "e4m3": Fp8Spec(E4M3, 448.0, 3, -6),
    "e5m2": Fp8Spec(E5M2, 57344.0, 2, -14),
}
BY_DTYPE = {jnp.dtype(s.dtype): s for s in SPECS.values()}


def spec(dtype) -> Fp8Spec:
    try:
        return BY_DTYPE[jnp.dtype(dtype)]
    except KeyError:
        raise ValueError(f"not an FP8 training format: {dtype} (expected float8_e4m3fn or float8_e5m2)") from None


def _float_bits(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 x -> (biased exponent, mantissa bits) as int32: x = 1.mantissa * 2^(exponent - 127) when normal."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


# scales are kept within fp32's normal range, so that 1 / s is a normal number too (a GPU may flush subnormals)
MAX_SCALE_EXPONENT = 126


def scale_from_amax(amax: jax.Array, fp8_max: float, previous: jax.Array | float = 1.0, margin: int = 0) -> jax.Array:
    """s = the largest power of two with amax * s <= fp8_max * 2^-margin (fp32, within 2^+-126); `previous`
    where amax is 0, inf or nan. Integer arithmetic on the exponent and mantissa bits: no division, nothing rounded."""
    amax = jnp.asarray(amax, jnp.float32)
    ok = jnp.isfinite(amax) & (amax > 0)
    exponent, mantissa = _float_bits(jnp.where(ok, amax, 1.0))  # amax = 1.mantissa * 2^(exponent - 127)
    # the target fp8_max * 2^-margin (a scalar or per tensor, e.g. [3] for x, W, dy): exact in fp32
    t_exponent, t_mantissa = _float_bits(jnp.asarray(fp8_max, jnp.float32) * jnp.float32(2.0 ** -margin))
    # amax * 2^k <= target  <=>  k <= t_exponent - exponent, one less when amax's mantissa is the larger
    k = t_exponent - exponent - (mantissa > t_mantissa).astype(jnp.int32)
    k = jnp.clip(k, -MAX_SCALE_EXPONENT, MAX_SCALE_EXPONENT)  # a subnormal amax (exponent 0) lands on the clip
    fresh = jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)
    return jnp.where(ok, fresh, jnp.asarray(previous, jnp.float32))


def amax(x: jax.Array) -> jax.Array:
    """max |x| as an fp32 scalar."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def dequant_factor(scale: jax.Array, compute_dtype) -> jax.Array:
    """d = 1 / s in the compute dtype (the factor the GEMM multiplies by): exact for scale_from_amax's powers of
    two."""
    return (1.0 / scale).astype(compute_dtype)


def quantize(x: jax.Array, d: jax.Array, dtype) -> jax.Array:
    """x -> FP8 `dtype` with dequantisation factor d: saturate(rne(x / d)). Computed in fp32."""
    bound = spec(dtype).max
    y = x.astype(jnp.float32) * (1.0 / d.astype(jnp.float32))
    return jnp.clip(y, -bound, bound).astype(dtype)


def dequantize(q: jax.Array, d: jax.Array, dtype) -> jax.Array:
    """q * d in `dtype` (the qdq GEMM operand; the default direct form multiplies the GEMM's result instead, see
    fp8_matmul: XLA GPU may rewrite the convert pair of quantize + dequantize away)."""
    return q.astype(dtype) * d.astype(dtype)


def quantize_both(x: jax.Array, d: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [R, C] -> (quantize(x, d, dtype), its transpose [C, R], max |x|): an FP8 GEMM operand in both layouts
    Hopper's FP8 GEMMs need (K-major: fp8_matmul), and the amax delayed scaling records. On a GPU one Pallas pass
    (pallas_kernels/fp8_cast) when its tiles divide x, else (and with SUROJAX_FP8_CAST=xla) XLA's three passes;
    the values are the same bits either way."""
    inv = 1.0 / d.astype(jnp.float32)
    return cast_transpose(x, inv, dtype, spec(dtype).max, use_kernel=None if cast_form() is Fp8Cast.AUTO else False)


def cast_form() -> Fp8Cast:
    """How `quantize_both` runs (`kernel_settings().fp8_cast`, SUROJAX_FP8_CAST): `auto` (default; the fused Pallas
    kernel on a GPU where it fits) or `xla` (convert, transpose and amax as XLA ops), for A/B runs
    (benchmarks/campaigns/fp8_h200.py)."""
    return kernel_settings().fp8_cast


def current_factor(x: jax.Array, dtype, compute_dtype, margin: int = 0) -> jax.Array:
    """Current scaling's dequantisation factor of x for the FP8 `dtype`: from x's own amax."""
    return dequant_factor(scale_from_amax(amax(x), spec(dtype).max, margin=margin), compute_dtype)


def quantize_current(x: jax.Array, dtype, compute_dtype, margin: int = 0) -> tuple[jax.Array, jax.Array]:
    """Current scaling: (q, d) from x's own amax."""
    d = current_factor(x, dtype, compute_dtype, margin)
    return quantize(x, d, dtype), d


# ---- the recipe's scaling settings --------------------------------------------------------------------------

class Fp8Scaling(enum.StrEnum):
    """fp8_scaling: how fp8_hybrid picks each tensor's scale (the config's strings are its values)."""
    CURRENT = "current"  # per tensor, by its own amax this step (fp8_matmul.py)
    DELAYED = "delayed"  # per tensor, by the amax history of the previous steps (fp8_delayed.py)
    BLOCKWISE = "blockwise"  # 1x128 tiles (activations, dy) / 128x128 blocks (weights), this step (fp8_blockwise.py)


SCALINGS = tuple(s.value for s in Fp8Scaling)  # fp8_scaling


@dataclasses.dataclass(frozen=True)
class Fp8Settings:
    """How fp8_hybrid scales its tensors (config keys fp8_scaling, fp8_amax_history, fp8_amax_compute_algo).

    scaling   `Fp8Scaling` (a config string is converted): CURRENT is this class's default (it needs no
              step-level state; the config's unset fp8_scaling is delayed, TrainConfig.resolved_fp8_scaling)
    amax_history / amax_compute_algo are read by DELAYED only."""
    scaling: Fp8Scaling = Fp8Scaling.CURRENT
    amax_history: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        try:
            object.__setattr__(self, "scaling", Fp8Scaling(self.scaling))
        except ValueError:
            raise ValueError(f"fp8_scaling: {self.scaling!r} is not one of {', '.join(SCALINGS)}") from None
        if self.amax_history < 1:
            raise ValueError(f"fp8_amax_history must be >= 1, got {self.amax_history}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"fp8_amax_compute_algo: {self.amax_compute_algo!r} is not one of "
                             f"{', '.join(AMAX_ALGOS)}")


# ---- delayed scaling ----------------------------------------------------------------------------------------



def roll_amax_history(history: jax.Array, scale: jax.Array, new_amax: jax.Array, fp8_max: float,
                      algo: str = "max", margin: int = 0) -> tuple[jax.Array, jax.Array]:
    """One delayed-scaling update after a step, for any number of tensors at once.

    history [..., H] fp32, newest first; scale [...] fp32 (the one the step used); new_amax [...] (the step's
    observed amaxes). The step's amax is rolled in at index 0 (the oldest drops out), then the scale for the next
    step is taken from `max` (the max over the history) or `most_recent` (index 0), Transformer Engine's order;
    where that amax is 0 or not finite the scale is kept. Returns (history, scale)."""
    if algo not in AMAX_ALGOS:
        raise ValueError(f"fp8_amax_compute_algo: {algo!r} is not one of {', '.join(AMAX_ALGOS)}")
    history = jnp.roll(history, 1, axis=-1).at[..., 0].set(jnp.asarray(new_amax, jnp.float32))
    amax_used = jnp.max(history, axis=-1) if algo == "max" else history[..., 0]
    return history, scale_from_amax(amax_used, fp8_max, scale, margin)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AmaxHistory:
    """Delayed-scaling state of one tensor: the amaxes of the last H steps (newest first) and the scale in use."""
    history: jax.Array  # [H] fp32
    scale: jax.Array  # [] fp32

    @classmethod
    def init(cls, length: int) -> "AmaxHistory":
        if length < 1:
            raise ValueError(f"fp8_amax_history must be >= 1, got {length}")
        return cls(jnp.zeros((length,), jnp.float32), jnp.ones((), jnp.float32))

    def next_scale(self, fp8_max: float, margin: int = 0) -> jax.Array:
        """The scale for the coming step: from the max over the history; the current one if that is not usable."""
        return scale_from_amax(jnp.max(self.history), fp8_max, self.scale, margin)

    def update(self, new_amax: jax.Array, fp8_max: float, margin: int = 0, algo: str = "max") -> "AmaxHistory":
        """After a step: `roll_amax_history` on this one tensor."""
        return AmaxHistory(*roll_amax_history(self.history, self.scale, new_amax, fp8_max, algo, margin))


# ---- independent reference ----------------------------------------------------------------------------------

def round_fp8_reference(x: jax.Array, fmt: str) -> jax.Array:
    """Round fp32 x to the values of an FP8 format with round-to-nearest-even and saturation at +-max, by
    arithmetic on exponent and mantissa (no FP8 dtype involved). Returns fp32. NaN stays NaN."""
    s = SPECS[fmt]
    x = jnp.asarray(x, jnp.float32)
    mag = jnp.abs(x)
    _, e = jnp.frexp(jnp.where(mag > 0, mag, 1.0))  # mag = m * 2^e, m in [0.5, 1)
    exponent = jnp.maximum(e - 1, s.min_exponent)  # subnormals share the smallest normal's spacing
    step = jnp.ldexp(jnp.float32(1.0), exponent - s.mantissa_bits)  # exact powers of two
    rounded = jnp.round(mag / step) * step  # jnp.round: half to even
    rounded = jnp.minimum(rounded, s.max)
    return jnp.where(jnp.isnan(x), x, jnp.sign(x) * rounded)


__all__ = ["E4M3", "E5M2", "SPECS", "Fp8Spec", "spec", "scale_from_amax", "MAX_SCALE_EXPONENT", "amax",
           "dequant_factor", "quantize", "dequantize", "quantize_both", "cast_form", "current_factor",
           "quantize_current", "AmaxHistory", "AMAX_ALGOS", "roll_amax_history", "SCALINGS", "Fp8Scaling", "Fp8Settings",
           "round_fp8_reference"]
