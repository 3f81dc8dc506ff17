"""How far apart are two quantisations of the same operands that differ only in whether the factor d = 1 / s was
rounded to bf16? The H200's fp8_gemm_check (session 13) found its FP8 GEMM 1.5% (LoRA: x quantised in the program)
and 2.1% (full: x and W) off the fp32 product of the same operands quantised op by op, with fast or fp32
accumulation alike. XLA GPU removes `f32 -> bf16 -> f32` round trips inside a program (SimplifyFPConversions under
xla_allow_excess_precision), so a program quantised with the exact fp32 scale where op-by-op code used
1 / bf16(1 / s). This emulates both on the check's own data (fp8_gemm_check's M x K x N GEMM, key 0), for
Transformer Engine's scale s = 448 / amax (the rule before session 14) and for that scale rounded down to a power
of two (fp8_scaling.scale_from_amax now), whose d is exact in bf16.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/campaigns/fp8_grid_shift.py          # ~10 s on 2 cores
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from surojax.precision.fp8_matmul import reference_dot
from surojax.precision.fp8_scaling import E4M3, amax, quantize, scale_from_amax


def te_scale(a):
    return jnp.float32(448.0) / a


def quantised(t, scale_rule, round_d: bool):
    """(q, d): t on the E4M3 grid of s = scale_rule(amax); round_d: d = bf16(1 / s) defines the grid (op by op),
    else d stays fp32 (inside a program whose f32 -> bf16 -> f32 round trip XLA removed)."""
    s = scale_rule(amax(t))
    d = (1.0 / s).astype(jnp.bfloat16).astype(jnp.float32) if round_d else 1.0 / s
    return quantize(t, d, E4M3), d


def rel(y, ref) -> float:
    return float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="16384x1024x3072", help="M x K x N (fp8_gemm_check's GEMM)")
    m, k, n = (int(v) for v in ap.parse_args().shape.split("x"))
    kx, kw, _ = jax.random.split(jax.random.key(0), 3)  # fp8_gemm_check's operands
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    print("| scale | x values moved | LoRA (x in the program) | full (x and W in the program) |")
    print("|---|---|---|---|")
    for name, rule in (("448 / amax (before)", te_scale),
                       ("power of two (now)", lambda a: scale_from_amax(a, 448.0))):
        eager_x, eager_w = quantised(x, rule, True), quantised(w, rule, True)
        prog_x, prog_w = quantised(x, rule, False), quantised(w, rule, False)
        ref = reference_dot(*eager_x, *eager_w)
        moved = int(jnp.sum(prog_x[0].astype(jnp.float32) != eager_x[0].astype(jnp.float32)))
        lora = rel(reference_dot(*prog_x, *eager_w), ref)
        full = rel(reference_dot(*prog_x, *prog_w), ref)
        print(f"| {name} | {moved:,} of {x.size:,} | {100 * lora:.2f}% | {100 * full:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
