"""Does `recipe: fp8_hybrid` really run FP8 GEMMs on this GPU, and what do they buy?

XLA rewrites `dot(convert(f8 a) * a_d, convert(f8 b) * b_d)` into a scaled FP8 GEMM only on Hopper or newer, and
only when the pattern survives its passes; otherwise the recipe computes the same numbers through bf16 GEMMs plus
the quantisation passes: a slowdown. This script reads the compiled HLO (`jit(f).lower(...).compile().as_text()`)
and counts the GEMMs by kind and operand dtype:

    cublasLt-f8   custom-call `__cublas$lt$matmul$f8`              (FP8 tensor cores)
    triton-f8     a `__triton_gemm` fusion whose dot reads f8 operands (FP8 tensor cores, Triton)
    bf16 / f32    cuBLAS / Triton / plain dot on 16- or 32-bit operands (the f8 -> bf16 converts not folded)

Three parts:
  1. ops    fp8_dot / fp8_dot_frozen on one Qwen3-0.6B-sized GEMM (M = 16384 tokens): forward and forward +
            backward, checked against the fp32 product of the dequantised operands (max |y - ref| / max |ref| <
            1e-2), GEMM census, time vs the bf16 GEMM (median of 3 x `iters` calls)
            (both ways of writing the scaled GEMM, SUROJAX_FP8_DOT=qdq | direct, see fp8_matmul.dot_form)
  2. step   the `surojax bench train` step (same build path as the trainer: build_model applies the recipe) of
            --shape / --mode with --recipe fp8_hybrid: GEMM census of the compiled step (compile only, no run), in the first of --forms
            then the bench's timing of that step, bf16 and fp8_hybrid (5 steps each; --no-step-time skips it)
  3. verdict `FP8 GEMMS USED: yes/no` per part, a table, and one JSON line per measurement

    PYTHONPATH=$PWD python benchmarks/fp8_gemm_check.py                                 # H200, ~3 min (qwen3-small)
    PYTHONPATH=$PWD python benchmarks/fp8_gemm_check.py --shape qwen3-0.6b --unroll all # the bench's step
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/fp8_gemm_check.py --smoke       # CPU: tiny, no timing
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from surojax.precision.fp8_matmul import fp8_dot, fp8_dot_frozen, reference_dot
from surojax.precision.fp8_scaling import E4M3, quantize_current
from surojax.precision.fp8_transform import Fp8Weight

MAX_REL_ERR = 1e-2
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s")
_OPERANDS = re.compile(r"\b(?:custom-call|fusion|dot)\((.*?)\)(?:,|$)")
_DTYPE = re.compile(r"\b(f8e4m3fn|f8e5m2|bf16|f16|f32|s8)\[")
_NAME = re.compile(r"%([\w.\-]+)")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def _computations(hlo: str) -> dict[str, str]:
    """computation name -> its body text."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), []
            continue
        if line.startswith("}") and name is not None:
            out[name] = "\n".join(lines)
            name = None
            continue
        if name is not None:
            lines.append(line)
    return out


def _result_dtypes(hlo: str) -> dict[str, str]:
    """instruction name -> its result dtype (newer XLA prints operands by name only)."""
    out = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m:
            dt = _DTYPE.match(m.group(2))
            if dt:
                out[m.group(1)] = dt.group(1)
    return out


_TYPES: dict[str, str] = {}


def _operand_dtypes(line: str) -> list[str]:
    m = _OPERANDS.search(line)
    if not m:
        return []
    typed = _DTYPE.findall(m.group(1))  # older XLA prints `f8e4m3fn[..] %x`
    return typed or [_TYPES[n] for n in _NAME.findall(m.group(1)) if n in _TYPES]


def gemm_census(hlo: str) -> dict[str, int]:
    """Count the GEMMs of a compiled HLO module by kind and operand dtype."""
    comps = _computations(hlo)
    _TYPES.clear()
    _TYPES.update(_result_dtypes(hlo))
    count: dict[str, int] = {}

    def add(key):
        count[key] = count.get(key, 0) + 1

    for line in hlo.splitlines():
        if not _INSTR.match(line):
            continue
        if "custom_call_target=\"__cublas$lt$matmul$f8\"" in line:
            add("cublasLt-f8")
        elif "custom_call_target=\"__cublas" in line:
            add(f"cublas-{_wide(_operand_dtypes(line))}")
        elif "__triton_gemm" in line and " fusion(" in line:
            called = _CALLS.search(line)
            body = comps.get(called.group(1), "") if called else ""
            dots = [ln for ln in body.splitlines() if " dot(" in ln]
            f8 = any(d.startswith("f8") for ln in dots for d in _operand_dtypes(ln))
            add("triton-f8" if f8 else f"triton-{_wide(_operand_dtypes(line))}")
        elif re.search(r"=\s*\S+\s+dot\(", line):
            dt = _operand_dtypes(line)
            add("dot-f8" if any(d.startswith("f8") for d in dt) else f"dot-{_wide(dt)}")
    return count


def _wide(dtypes: list[str]) -> str:
    for d in ("f32", "bf16", "f16"):
        if d in dtypes:
            return d
    return dtypes[0] if dtypes else "?"


def fp8_used(census: dict[str, int]) -> bool:
    return any(k in ("cublasLt-f8", "triton-f8") for k in census)


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def _time(fn, args, iters: int) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def emit(rows: list, record: dict) -> None:
    rows.append(record)
    print(json.dumps(record), flush=True)


def _fwd_bwd(f, g, *primals):
    """(y, cotangents): the forward output and the backward products, both live (nothing dead-code eliminated)."""
    y, vjp = jax.vjp(f, *primals)
    return y, vjp(g)


def part_ops(rows, M: int, K: int, N: int, iters: int, timing: bool, forms: list[str]) -> dict:
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (M, N), jnp.float32).astype(jnp.bfloat16)
    fw = Fp8Weight.quantize(w)

    # correctness: the fp8 forward against the fp32 product of the same dequantised operands
    x_q, x_d = quantize_current(x, E4M3, jnp.bfloat16)
    ref = reference_dot(x_q, x_d, fw.q, fw.d)
    w_q, w_d = quantize_current(w, E4M3, jnp.bfloat16)
    ref_w = reference_dot(x_q, x_d, w_q, w_d)
    errs = {
        "frozen": float(jnp.max(jnp.abs(jax.jit(fp8_dot_frozen)(x, fw.q, fw.d).astype(jnp.float32) - ref))
                        / jnp.max(jnp.abs(ref))),
        "trainable": float(jnp.max(jnp.abs(jax.jit(fp8_dot)(x, w).astype(jnp.float32) - ref_w))
                           / jnp.max(jnp.abs(ref_w))),
    }

    variants = {
        "bf16 fwd": (lambda x, w: x @ w, (x, w)),
        "fp8 frozen fwd": (lambda x, q, d: fp8_dot_frozen(x, q, d), (x, fw.q, fw.d)),
        "fp8 trainable fwd": (fp8_dot, (x, w)),
        # LoRA: y and dx (the frozen weight gets no gradient)
        "bf16 fwd+dx": (lambda x, w, g: _fwd_bwd(lambda x: x @ w, g, x), (x, w, g)),
        "fp8 frozen fwd+dx": (lambda x, q, d, g: _fwd_bwd(lambda x: fp8_dot_frozen(x, q, d), g, x),
                              (x, fw.q, fw.d, g)),
        # full fine-tuning: y, dx and dw
        "bf16 fwd+dx+dw": (lambda x, w, g: _fwd_bwd(lambda x, w: x @ w, g, x, w), (x, w, g)),
        "fp8 trainable fwd+dx+dw": (lambda x, w, g: _fwd_bwd(fp8_dot, g, x, w), (x, w, g)),
    }
    any_fp8 = {}
    for form in forms:
        os.environ["SUROJAX_FP8_DOT"] = form  # read when the fp8 functions are traced (each variant is new)
        for name, (fn, args) in variants.items():
            if form != forms[0] and not name.startswith("fp8"):
                continue
            label = f"{name} [{form}]" if name.startswith("fp8") else name
            census = gemm_census(_compiled_text(lambda *a, fn=fn: fn(*a), *args))
            used = fp8_used(census)
            if name.startswith("fp8"):
                any_fp8[form] = any_fp8.get(form, False) or used
            ms = _time(lambda *a, fn=fn: fn(*a), args, iters) * 1e3 if timing else None
            emit(rows, {"part": "ops", "variant": label, "dot_form": form, "M": M, "K": K, "N": N, "ms": ms,
                        "gemms": census, "fp8_gemms_used": used,
                        "max_rel_err": errs["frozen" if "frozen" in name else "trainable"]
                        if name.startswith("fp8") else None})
    os.environ["SUROJAX_FP8_DOT"] = forms[0]
    ok = all(e < MAX_REL_ERR for e in errs.values())
    print(f"ops: max rel err vs dequantised fp32 product {errs} -> {'OK' if ok else 'FAIL'}", file=sys.stderr)
    if not ok:
        raise SystemExit("fp8 matmul disagrees with its reference")
    return any_fp8


def part_step(rows, shape: str, mode: str, batch: int, seq: int, unroll, time_steps: bool) -> bool:
    from surojax.bench.train_bench import BenchConfig, build, place_batch, synthetic_batch
    import numpy as np

    bc = BenchConfig(shape=shape, mode=mode, batch=batch, seq=seq, recipe="fp8_hybrid", unroll_layers=unroll,
                     segments=1, min_segment=1, steps=1, repeats=1)
    bc.check()
    t0 = time.perf_counter()
    s = build(bc)
    host, _ = synthetic_batch(np.random.default_rng(0), 1, batch, seq, s.model_cfg.vocab_size, 1, 1)
    batch_dev = place_batch(s, host)
    hlo = s.step.lower(s.trainable, s.frozen, s.opt_state, batch_dev, jax.random.key(0)).compile().as_text()
    census = gemm_census(hlo)
    used = fp8_used(census)
    emit(rows, {"part": "step", "variant": f"{shape} {mode} fp8_hybrid", "batch": batch, "seq": seq,
                "unroll_layers": unroll, "gemms": census, "fp8_gemms_used": used,
                "compile_s": time.perf_counter() - t0})
    del s, batch_dev
    if time_steps:  # the bench's own timing (build + compile + 2 warm-up + 5 steps), bf16 then fp8_hybrid
        from surojax.bench.train_bench import run

        for recipe in ("bf16", "fp8_hybrid"):
            bc_t = BenchConfig(shape=shape, mode=mode, batch=batch, seq=seq, recipe=recipe, unroll_layers=unroll,
                               steps=5, repeats=1, min_segment=min(64, seq // 4))
            rec = run(bc_t, log=lambda m: print(m, file=sys.stderr, flush=True))
            emit(rows, {"part": "step-time", "variant": f"{shape} {mode} {recipe}", "ms": rec["step_ms"],
                        "tokens_per_s": rec["tokens_per_s"], "peak_gib": rec["peak_gib"], "loss": rec["loss"],
                        "gemms": {}, "fp8_gemms_used": None})
    return used


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, no timing")
    p.add_argument("--shape", default="qwen3-small", help="bench shape of the step census (qwen3-0.6b: the bench's)")
    p.add_argument("--mode", default="lora", choices=("lora", "full", "both"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--unroll", default="1", help="layers per scan iteration, or 'all'")
    p.add_argument("--no-step-time", action="store_true", help="skip timing the step (bf16 vs fp8_hybrid)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--forms", default="qdq,direct", help="SUROJAX_FP8_DOT forms to compile and time (ops part)")
    p.add_argument("--mkn", default="16384,1024,3072", help="M,K,N of the op benchmark (default: 0.6B gate/up)")
    args = p.parse_args()
    if args.smoke:
        args.shape, args.batch, args.seq, args.mkn, args.mode = "debug", 2, 64, "64,64,128", "both"
    M, K, N = (int(v) for v in args.mkn.split(","))
    unroll = True if args.unroll == "all" else int(args.unroll)
    print(f"devices: {jax.devices()}; jax {jax.__version__}", file=sys.stderr)
    rows: list = []
    forms = args.forms.split(",")
    ops_fp8 = part_ops(rows, M, K, N, args.iters, timing=not args.smoke, forms=forms)
    step_fp8 = {m: part_step(rows, args.shape, m, args.batch, args.seq, unroll, time_steps=not args.smoke
                             and not args.no_step_time)
                for m in (("lora", "full") if args.mode == "both" else (args.mode,))}

    print("\n| part | variant | ms | GEMMs (kind: count) | fp8 used |")
    print("|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") is not None else "-"
        gemms = ", ".join(f"{k}: {v}" for k, v in sorted(r["gemms"].items())) or "-"
        if "tokens_per_s" in r:
            gemms = f"{r['tokens_per_s']:,.0f} tok/s, loss {r['loss']:.4f}"
        print(f"| {r['part']} | {r['variant']} | {ms} | {gemms} | {r['fp8_gemms_used']} |")
    t = {r["variant"]: r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    for m in step_fp8:
        a, b = t.get(f"{args.shape} {m} bf16"), t.get(f"{args.shape} {m} fp8_hybrid")
        if a and b:
            print(f"\nstep {args.shape} {m}: fp8_hybrid / bf16 tokens/s = {b / a:.3f}")
    by = {r["variant"]: r.get("ms") for r in rows}
    for form in forms:
        lora, full = by.get(f"fp8 frozen fwd+dx [{form}]"), by.get(f"fp8 trainable fwd+dx+dw [{form}]")
        if lora and full:
            print(f"\n[{form}] fp8 / bf16 time: LoRA fwd+dx {lora / by['bf16 fwd+dx']:.2f}x, "
                  f"full fwd+dx+dw {full / by['bf16 fwd+dx+dw']:.2f}x")
    print("FP8 GEMMS USED: " + "; ".join(f"ops [{f}] {'yes' if u else 'NO'}" for f, u in ops_fp8.items())
          + "; " + "; ".join(f"step {m} [{forms[0]}] {'yes' if u else 'NO'}" for m, u in step_fp8.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
