"""The kernel choices of a process: typed settings, read once, that the traced code reads instead of os.environ.

    kernel_settings()                 the process's KernelSettings: the defaults, with the SUROJAX_* overrides of
                                      the environment read on first use (once; a bad value names its variable)
    use_kernel_settings(**changes)    a context in which other settings hold (tests; A/B in one process)
    set_kernel_settings(settings)     the same for the rest of the process (a benchmark's loop over variants)
    KernelSettings.summary_lines()    one line per override: the start-up summary of `surojax train`, `surojax
                                      bench train` and `surojax serve` prints them

    field          variable               values (default first)   read by
    fp8_dot        SUROJAX_FP8_DOT        direct | qdq             precision/fp8_matmul: how the scaled GEMM is written
    fp8_accum      SUROJAX_FP8_ACCUM      split | fp32 | fast      precision/fp8_matmul: the FP8 GEMMs' accumulation
    fp8_wgrad      SUROJAX_FP8_WGRAD      compute | weight         precision/fp8_matmul: the weight-gradient's dtype
    fp8_cast       SUROJAX_FP8_CAST       auto | xla               precision/fp8_scaling: the cast + transpose kernel
    quant_matmul   SUROJAX_QUANT_MATMUL   auto | pallas | xla      quant/: the quantised matmul's kernel
    adam8bit       SUROJAX_ADAM8BIT       auto | kernel | xla      train/optim_8bit_fused: the fused 8-bit AdamW
    gated_delta    SUROJAX_GATED_DELTA    auto | pallas | pallas_v2 | chunked | reference
                                                                   models/layers/deltanet_cache: the chunked gated
                                                                   delta rule (pallas_kernels/gated_delta impl)
    gated_delta_bwd  SUROJAX_GATED_DELTA_BWD  auto | kernels | jnp  the same, impl pallas_v2's backward: its four
                                                                   Pallas kernels (kernel_v2_bwd.py) or backward_v2.py's
                                                                   jnp; auto = the kernels on a GPU (measured: 2.9x the
                                                                   jnp, pallas_kernels/gated_delta/api.py), jnp elsewhere
    moe_decode     SUROJAX_MOE_DECODE     auto | gather | grouped  models/layers/moe: few-row MoE calls gather the
                                                                   routed experts' weights (auto: by the crossover
                                                                   there) or run the grouped GEMM over all experts
    moe_gather_kernel  SUROJAX_MOE_GATHER_KERNEL  auto | pallas | xla  models/layers/moe: the gathered form's products
                                                                   (plain float experts, on a GPU) by the gathered
                                                                   GEMV kernel (pallas_kernels/gathered_gemv: each
                                                                   routed expert read in place, no gathered copy) or
                                                                   XLA's gather + product; auto = the kernel on a GPU
                                                                   (1.18x XLA at one row, H100). Quantised experts:
                                                                   pallas lays them out at load for the gathered
                                                                   quantised GEMV (gathered_gemv/quant_kernel.py);
                                                                   auto = XLA until it is measured. Ignored off a GPU
    decode_gemv    SUROJAX_DECODE_GEMV    auto | pallas | xla      quant/gemv_weight: a served model's plain (bf16 /
                                                                   fp32) linears laid out [N, K] at load for the
                                                                   decode GEMV kernel (pallas_kernels/decode_gemv),
                                                                   which takes calls of <= 64 rows (a tensor-core
                                                                   body above 8); auto = the kernel on a GPU up to 8
                                                                   rows (one user 1.40x XLA, measured on an H100)
                                                                   and its dot body up to 64 (Qwen3-8B at 16 / 64
                                                                   users 1.56x / 1.38x XLA: api.AUTO_DOT_MAX_M).
                                                                   pallas also lays quantised linears out for the
                                                                   quantised decode GEMV (quant/gemv_quant: <= 8
                                                                   rows, the same fusions); auto: not until measured
    decode_prologue  SUROJAX_DECODE_PROLOGUE  auto | pallas | xla  models/layers/attention: a decode call (one token per
                                                                   row, <= 8 rows) over the serving pool runs qkv's
                                                                   split, the q / k norms, rope and the k / v write into
                                                                   the pool as one kernel (pallas_kernels/
                                                                   decode_prologue); auto = the kernel on a GPU (one user
                                                                   +3 to +9% in the engine, measured on an H100)

Each choice changes what compiles, not what a config means: the defaults are the measured best (the modules above
say why), the variables exist for A/B runs. A variable that changed what compiles without a word was the defect
this module removes: every one set is printed at start-up. Nothing heavy is imported here (no jax).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Iterator, Mapping


class Fp8Dot(enum.StrEnum):
    DIRECT = "direct"  # dot_general on the FP8 arrays, times a_d * b_d (XLA GPU: a cuBLASLt FP8 GEMM)
    QDQ = "qdq"        # dot(convert(a_q) * a_d, convert(b_q) * b_d): the textbook pattern XLA may leave in bf16


class Fp8Accum(enum.StrEnum):
    SPLIT = "split"  # forward GEMMs fast accumulation, gradient GEMMs fp32 (Transformer Engine's choice)
    FP32 = "fp32"    # every FP8 GEMM accumulates in fp32
    FAST = "fast"    # every FP8 GEMM fast


class Fp8Wgrad(enum.StrEnum):
    COMPUTE = "compute"  # the weight-gradient GEMM writes the compute dtype
    WEIGHT = "weight"    # ... the weight's own dtype


class Fp8Cast(enum.StrEnum):
    AUTO = "auto"  # the fused Pallas cast + transpose on a GPU where its tiles fit
    XLA = "xla"    # XLA's convert, transpose and amax


class QuantMatmul(enum.StrEnum):
    AUTO = "auto"      # XLA off a GPU; on one the kernel where it was measured faster
    PALLAS = "pallas"  # the fused dequantise + matmul kernels always (interpret mode off a GPU)
    XLA = "xla"        # dequantise, then XLA's GEMM


class Adam8bit(enum.StrEnum):
    AUTO = "auto"      # the fused kernel on a GPU, the per-layer loop elsewhere
    KERNEL = "kernel"  # the kernel always (interpret mode off a GPU)
    XLA = "xla"        # the per-layer loop


class MoeDecode(enum.StrEnum):
    AUTO = "auto"        # gather where X * k assignments are few against E (moe.GATHER_CROSSOVER), else grouped
    GATHER = "gather"    # gather each assignment's expert weights and multiply row by row, at every size
    GROUPED = "grouped"  # the grouped GEMM over all E experts at every size (the path before the gather existed)


class MoeGatherKernel(enum.StrEnum):
    AUTO = "auto"      # XLA until the kernel is measured on a GPU (pallas_kernels/gathered_gemv/api.py)
    PALLAS = "pallas"  # the gathered GEMV kernels on a GPU: plain float experts, and quantised ones laid out at load
    XLA = "xla"        # XLA's gather of the routed experts' weights, then the row-by-row product


class DecodeGemv(enum.StrEnum):
    AUTO = "auto"      # the kernel where measured faster on a GPU (pallas_kernels/decode_gemv/api.py AUTO_MAX_M)
    PALLAS = "pallas"  # the kernels for every decode call they take, quantised linears too (interpret mode off a GPU)
    XLA = "xla"        # the weights stay [K, N], XLA's GEMV


class DecodePrologue(enum.StrEnum):
    AUTO = "auto"      # the kernel on a GPU (measured: pallas_kernels/decode_prologue/api.py), xla elsewhere
    PALLAS = "pallas"  # the fused prologue kernel for every decode call it takes (interpret mode off a GPU)
    XLA = "xla"        # XLA's split, norms, rope and scatter into the pool


class GatedDelta(enum.StrEnum):
    AUTO = "auto"            # pallas_kernels/gated_delta's measured choice for the backend
    PALLAS = "pallas"        # the Pallas (Triton) forward and backward kernels (interpret mode off a GPU)
    PALLAS_V2 = "pallas_v2"  # fla's kernel layout as Pallas kernels: three forward, four backward
    CHUNKED = "chunked"      # the chunked jnp form (XLA)
    REFERENCE = "reference"  # the token-by-token recurrence (tests, checks; slow)


class GatedDeltaBwd(enum.StrEnum):
    AUTO = "auto"        # jnp until the kernels are measured on a GPU (pallas_kernels/gated_delta/api.py)
    KERNELS = "kernels"  # kernel_v2_bwd.py's four Pallas kernels (fla's chunk-backward layout)
    JNP = "jnp"          # backward_v2.py: the same decomposition in jnp


VARIABLES: dict[str, str] = {  # field -> its environment variable
    "fp8_dot": "SUROJAX_FP8_DOT", "fp8_accum": "SUROJAX_FP8_ACCUM", "fp8_wgrad": "SUROJAX_FP8_WGRAD",
    "fp8_cast": "SUROJAX_FP8_CAST", "quant_matmul": "SUROJAX_QUANT_MATMUL", "adam8bit": "SUROJAX_ADAM8BIT",
    "gated_delta": "SUROJAX_GATED_DELTA", "gated_delta_bwd": "SUROJAX_GATED_DELTA_BWD",
    "moe_decode": "SUROJAX_MOE_DECODE", "moe_gather_kernel": "SUROJAX_MOE_GATHER_KERNEL",
    "decode_gemv": "SUROJAX_DECODE_GEMV",
    "decode_prologue": "SUROJAX_DECODE_PROLOGUE",
}


class KernelSettingsError(ValueError):
    is_user_error = True


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    fp8_dot: Fp8Dot = Fp8Dot.DIRECT
    fp8_accum: Fp8Accum = Fp8Accum.SPLIT
    fp8_wgrad: Fp8Wgrad = Fp8Wgrad.COMPUTE
    fp8_cast: Fp8Cast = Fp8Cast.AUTO
    quant_matmul: QuantMatmul = QuantMatmul.AUTO
    adam8bit: Adam8bit = Adam8bit.AUTO
    gated_delta: GatedDelta = GatedDelta.AUTO
    gated_delta_bwd: GatedDeltaBwd = GatedDeltaBwd.AUTO
    moe_decode: MoeDecode = MoeDecode.AUTO
    moe_gather_kernel: MoeGatherKernel = MoeGatherKernel.AUTO
    decode_gemv: DecodeGemv = DecodeGemv.AUTO
    decode_prologue: DecodePrologue = DecodePrologue.AUTO
    from_environment: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)
    """the variables that were set when these settings were read (printed even where they name the default)"""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name in VARIABLES:  # a spelling given in code ("qdq") becomes its enum member, or is refused
                object.__setattr__(self, f.name, _member(f.name, getattr(self, f.name)))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> KernelSettings:
        """The defaults with every SUROJAX_* variable of `environ` that is set (an empty value: unset)."""
        values = {field: environ[var].strip().lower() for field, var in VARIABLES.items()
                  if environ.get(var, "").strip()}
        return cls(**values, from_environment=frozenset(VARIABLES[f] for f in values))

    def overrides(self) -> dict[str, str]:
        """variable -> value of every setting that is not its default or was set in the environment."""
        default = KernelSettings()
        return {var: getattr(self, field).value for field, var in VARIABLES.items()
                if getattr(self, field) != getattr(default, field) or var in self.from_environment}

    def summary_lines(self) -> list[str]:
        """The start-up summary's line of the overrides ([] with none)."""
        over = self.overrides()
        if not over:
            return []
        return ["kernels " + ", ".join(f"{var}={value}" for var, value in over.items())
                + " (environment overrides for A/B runs: they change what compiles)"]


def _member(field: str, value):
    kind = type(getattr(KernelSettings, field))
    try:
        return kind(value)
    except ValueError:
        raise KernelSettingsError(f"{VARIABLES[field]}={value!r}: expected one of "
                                  f"{', '.join(m.value for m in kind)}") from None


_current: KernelSettings | None = None


def kernel_settings() -> KernelSettings:
    """The process's settings: read from the environment on first use, the same afterwards."""
    global _current
    if _current is None:
        _current = KernelSettings.from_environ()
    return _current


def set_kernel_settings(settings: KernelSettings) -> KernelSettings:
    """Make `settings` the process's from now on (a script's A/B loop); -> the ones they replace. Functions
    traced afterwards compile with them (jit caches by function: trace a fresh one per setting)."""
    global _current
    before = kernel_settings()
    _current = settings
    return before


@contextlib.contextmanager
def use_kernel_settings(settings: KernelSettings | None = None, **changes) -> Iterator[KernelSettings]:
    """Within the block, `settings` (default: the current ones) with `changes` (values or their spellings)."""
    before = set_kernel_settings(dataclasses.replace(settings or kernel_settings(), **changes))
    try:
        yield kernel_settings()
    finally:
        set_kernel_settings(before)


__all__ = ["VARIABLES", "Adam8bit", "DecodeGemv", "DecodePrologue", "Fp8Accum", "Fp8Cast", "Fp8Dot", "Fp8Wgrad", "GatedDelta", "GatedDeltaBwd", "KernelSettings",
           "KernelSettingsError", "MoeDecode", "MoeGatherKernel", "QuantMatmul", "kernel_settings",
           "set_kernel_settings", "use_kernel_settings"]
