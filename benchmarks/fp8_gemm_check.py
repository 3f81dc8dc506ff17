"""Does `recipe: fp8_hybrid` really run FP8 GEMMs on this GPU, are they right, and what do they buy?

XLA runs an FP8 GEMM (cuBLASLt `__cublas$lt$matmul$f8`, or Triton on FP8 operands) only on Ada / Hopper or newer
and only when the FP8 operands survive its passes; otherwise the recipe computes through bf16 GEMMs plus the
quantisation passes: a slowdown. This script reads the compiled HLO (`jit(f).lower(...).compile().as_text()`)
and counts the GEMMs by kind and operand dtype:

    cublasLt-f8   custom-call `__cublas$lt$matmul$f8`              (FP8 tensor cores)
    triton-f8     a `__triton_gemm` fusion whose dot reads f8 operands (FP8 tensor cores, Triton)
    bf16 / f32    cuBLAS / Triton / plain dot on 16- or 32-bit operands (the f8 -> bf16 converts not folded)

Three parts:
  1. ops    fp8_dot / fp8_dot_frozen on one Qwen3-0.6B-sized GEMM (M = 16384 tokens): forward and forward +
            backward; each forward is checked against the fp32 (HIGHEST) product of the dequantised FP8 operands
            that the same program multiplied (returned beside y): max |y - ref| / max |ref| below
            fp8_matmul.DIRECT_REL_ERR (direct, 6e-3: the bf16 result and accumulation order) or QDQ_REL_ERR
            (qdq, 1e-2). It also prints the error against operands quantised eagerly, op by op, and where they
            differ: with the power-of-two scales they are the same bits (before them, XLA GPU dropped the bf16
            rounding of d = 1 / s inside the program, every element sat on another E4M3 grid, and the H200
            showed 1.5% / 2.1% of difference that was not the GEMM's: session 13, explained in session 14).
            It also prints the error of the qdq GEMM with XLA's convert
            chains f32 -> f8 -> bf16 collapsed to f32 -> bf16 (2.69 % frozen / 3.71 % trainable here): a match
            means XLA removed the quantisers, as it did for qdq on the H200 (jax 0.11.2: 2.67 % / 3.71 %).
            GEMM census, time vs the bf16 GEMM (median of 3 x `iters` calls).
            --forms: SUROJAX_FP8_DOT forms (direct | qdq), each optionally compiled with XLA options:
            +noexcess (xla_allow_excess_precision=false: no SimplifyFPConversions) and +notriton
            (xla_gpu_enable_triton_gemm=false: the cuBLASLt FP8 rewriter sees the dot first); diagnostics only;
            +fast / +fp32: SUROJAX_FP8_ACCUM of that variant (default split: fast forward, fp32 gradients).
  2. step   the `surojax bench train` step (same build path as the trainer: build_model applies the recipe) of
            --shape / --mode with --recipe fp8_hybrid in the first of --forms: GEMM census of the compiled step,
            then the bench's timing of that step, bf16 and fp8_hybrid (5 steps each; --no-step-time skips it).
            A failed ops check does not stop it.
  3. verdict `OPS CHECK` and `FP8 GEMMS USED` per form and part, a table, one JSON line per measurement; exit 1
            (after everything ran) when an ops check failed.

    PYTHONPATH=$PWD python benchmarks/fp8_gemm_check.py --shape qwen3-0.6b --mode lora   # H200, ~3 min
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/fp8_gemm_check.py --smoke       # CPU: tiny, no timing
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from surojax.kernel_settings import kernel_settings, set_kernel_settings
from surojax.precision.fp8_matmul import (DIRECT_REL_ERR, QDQ_REL_ERR, _fp8_dot_fwd, fp8_dot, fp8_dot_frozen,
                                          reference_dot)
from surojax.precision.fp8_scaling import E4M3, E5M2, dequantize, quantize_current
from surojax.precision.fp8_transform import Fp8Weight
from surojax.train.step import steady_state

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


# --forms entries: SUROJAX_FP8_DOT form, optionally +xla-option shorthands compiled into that variant only
XLA_VARIANTS = {
    "notriton": {"xla_gpu_enable_triton_gemm": False},  # the FP8 rewriter sees the dot before Triton's GemmFusion
    "noexcess": {"xla_allow_excess_precision": False},  # no SimplifyFPConversions: f32 -> f8 -> bf16 kept
}


ACCUM_VARIANTS = {"fast": "fast", "fp32": "fp32"}  # SUROJAX_FP8_ACCUM of that variant (default split)


def _accum(entry: str) -> str:
    return next((ACCUM_VARIANTS[e] for e in entry.split("+")[1:] if e in ACCUM_VARIANTS), "split")


def _parse_form(entry: str) -> tuple[str, dict]:
    form, *extra = entry.split("+")
    options = {}
    for e in extra:
        if e in ACCUM_VARIANTS:
            continue
        if e not in XLA_VARIANTS:
            raise SystemExit(f"--forms {entry!r}: unknown variant {e!r} (expected one of {sorted(XLA_VARIANTS)})")
        options.update(XLA_VARIANTS[e])
    return form, options


def _compile(fn, args, options=None):
    return jax.jit(fn).lower(*args).compile(compiler_options=options or None)


def _compiled_text(fn, *args) -> str:
    return _compile(fn, args).as_text()


def _time(fn, args, iters: int) -> float:
    """fn: a jitted function or a compiled executable."""
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


def _rel(y, ref) -> float:
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))


def _quantiser_dropped(t, d):
    """quantize + dequantize (qdq form) with its f32 -> f8 -> bf16 converts collapsed to f32 -> bf16."""
    bound = float(jnp.finfo(E4M3).max)
    return jnp.clip(t.astype(jnp.float32) * (1.0 / d.astype(jnp.float32)), -bound, bound).astype(jnp.bfloat16) \
        * d.astype(jnp.bfloat16)


def _bf16_gemm(a, b):
    """bf16 operands, fp32 accumulation, bf16 result (what a cuBLAS bf16 GEMM computes)."""
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest").astype(jnp.bfloat16)


def _own_operands(which: str, x, w, fw):
    """(y, (x_q, x_d, w_q, w_d)): the forward GEMM and the FP8 operands it multiplied, from one program."""
    if which == "trainable":  # the custom VJP's forward returns its operands as residuals (x^T, x_d, W, W_d)
        y, (x_qt, x_d, w_q, w_d, _) = jax.jit(_fp8_dot_fwd)(x, w)
        return y, (x_qt.T, x_d, w_q, w_d)
    y, (x_q, x_d) = jax.jit(lambda x, q, d: (fp8_dot_frozen(x, q, d), quantize_current(x, E4M3, jnp.bfloat16)))(
        x, fw.q, fw.d)
    return y, (x_q, x_d, fw.q, fw.d)


def _same_operands(which: str, own, eager) -> str:
    """Where the program's FP8 operands differ from the eagerly quantised ones: factors and element counts."""
    x_q, x_d, w_q, w_d = own
    ex_q, ex_d, ew_q, ew_d, fw = eager
    if which == "frozen":
        ew_q, ew_d = fw.q, fw.d
    diff = lambda a, b: int(jnp.sum(a.astype(jnp.float32) != b.astype(jnp.float32)))  # noqa: E731
    return (f"x_d {float(x_d):.6g} vs {float(ex_d):.6g}, {diff(x_q, ex_q)} x values differ; "
            f"w_d {float(jnp.ravel(w_d)[0]):.6g} vs {float(jnp.ravel(ew_d)[0]):.6g}, {diff(w_q, ew_q)} w values differ")


def part_ops(rows, M: int, K: int, N: int, iters: int, timing: bool, forms: list[str]) -> tuple[dict, dict]:
    """-> ({form: any FP8 GEMM}, {form: ops check passed})"""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (M, N), jnp.float32).astype(jnp.bfloat16)
    fw = Fp8Weight.quantize(w)

    # references (fp32, HIGHEST): the product of the same dequantised FP8 operands, and what a GEMM computes when
    # XLA drops the activation quantiser (x not rounded to E4M3; trainable: w neither), the H200 failure of qdq
    x_q, x_d = quantize_current(x, E4M3, jnp.bfloat16)
    w_q, w_d = quantize_current(w, E4M3, jnp.bfloat16)
    refs = {"frozen": reference_dot(x_q, x_d, fw.q, fw.d), "trainable": reference_dot(x_q, x_d, w_q, w_d)}
    # the backward GEMMs: dy in E5M2 (current scaling); dx = dy W^T, dW = x^T dy. The program's operands are the
    # eager ones (power-of-two scales; the forward rows print the count of values that differ)
    g_q, g_d = quantize_current(g, E5M2, jnp.bfloat16)
    grad_refs = {"frozen fwd+dx": {"dx": reference_dot(g_q, g_d, fw.q.T, fw.d)},
                 "trainable fwd+dx+dw": {"dx": reference_dot(g_q, g_d, w_q.T, w_d),
                                         "dw": reference_dot(x_q.T, x_d, g_q, g_d)}}
    dropped = {  # the qdq GEMM after XLA rewrote each convert chain f32 -> f8 -> bf16 as f32 -> bf16
        "frozen": _rel(_bf16_gemm(_quantiser_dropped(x, x_d), dequantize(fw.q, fw.d, jnp.bfloat16)), refs["frozen"]),
        "trainable": _rel(_bf16_gemm(_quantiser_dropped(x, x_d), _quantiser_dropped(w, w_d)), refs["trainable"]),
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
    any_fp8, ok = {}, {}
    for entry in forms:
        form, options = _parse_form(entry)
        bound = DIRECT_REL_ERR if form == "direct" else QDQ_REL_ERR
        # read when the fp8 functions are traced (each variant is new)
        set_kernel_settings(dataclasses.replace(kernel_settings(), fp8_dot=form, fp8_accum=_accum(entry)))
        for name, (fn, args) in variants.items():
            if entry != forms[0] and not name.startswith("fp8"):
                continue
            label = f"{name} [{entry}]" if name.startswith("fp8") else name
            compiled = _compile(lambda *a, fn=fn: fn(*a), args, options if name.startswith("fp8") else None)
            census = gemm_census(compiled.as_text())
            used = fp8_used(census)
            record = {"part": "ops", "variant": label, "dot_form": entry, "M": M, "K": K, "N": N, "ms": None,
                      "gemms": census, "fp8_gemms_used": used}
            if name.startswith("fp8"):
                any_fp8[entry] = any_fp8.get(entry, False) or used
            if name in ("fp8 frozen fwd", "fp8 trainable fwd"):  # the compiled program itself against the reference
                which = name.split()[1]
                err_eager = _rel(compiled(*args), refs[which])
                # the GEMM against the product of ITS OWN FP8 operands, returned by the same program: the bound is
                # about the GEMM given its operands; the eager reference's should be the same bits (power-of-two
                # scales: nothing left for a compiler to round otherwise); operands_as_eager says where they are not
                y_own, own = _own_operands(which, x, w, fw)
                err = _rel(y_own, reference_dot(*own))
                same = _same_operands(which, own, (x_q, x_d, w_q, w_d, fw))
                passed = err < bound
                ok[entry] = ok.get(entry, True) and passed
                record.update(max_rel_err=err, max_rel_err_vs_eager_operands=err_eager, operands_as_eager=same,
                              bound=bound, check="OK" if passed else "FAIL", err_if_quantiser_dropped=dropped[which])
                print(f"ops [{entry}] {which}: max rel err {err:.4f} vs the fp32 product of its own dequantised FP8 "
                      f"operands (bound {bound:.4f}) -> {'OK' if passed else 'FAIL'}; {err_eager:.4f} vs the eagerly "
                      f"quantised operands ({same}); the qdq GEMM with its f32->f8->bf16 converts collapsed "
                      f"(XLA's SimplifyFPConversions, the H200 failure) would be {dropped[which]:.4f} off",
                      file=sys.stderr, flush=True)
            if name.split(" ", 1)[-1] in grad_refs and name.startswith("fp8"):  # dx (and dW) of the same program
                which = name.split(" ", 1)[-1]
                _, grads = compiled(*args)
                errs = {k: _rel(got, grad_refs[which][k]) for k, got in zip(("dx", "dw"), grads)}
                passed = max(errs.values()) < bound
                ok[entry] = ok.get(entry, True) and passed
                record.update(max_rel_err=max(errs.values()), grad_rel_err=errs, bound=bound,
                              check="OK" if passed else "FAIL")
                print(f"ops [{entry}] {which}: " + ", ".join(f"{k} max rel err {e:.4f}" for k, e in errs.items())
                      + f" vs the fp32 product of the FP8 operands (dy E5M2; bound {bound:.4f}) -> "
                      f"{'OK' if passed else 'FAIL'}", file=sys.stderr, flush=True)
            if timing:
                record["ms"] = _time(compiled, args, iters) * 1e3
            emit(rows, record)
    set_kernel_settings(dataclasses.replace(kernel_settings(), fp8_dot=_parse_form(forms[0])[0],
                                            fp8_accum=_accum(forms[0])))
    return any_fp8, ok


def part_step(rows, shape: str, mode: str, batch: int, seq: int, unroll, time_steps: bool) -> bool:
    from surojax.bench.train_bench import BenchConfig, build, place_batch, synthetic_batch
    import numpy as np

    bc = BenchConfig(shape=shape, mode=mode, batch=batch, seq=seq, recipe="fp8_hybrid", unroll_layers=unroll,
                     segments=1, min_segment=1, steps=1, repeats=1)
    bc.check()
    t0 = time.perf_counter()
    s = build(bc)
    host, _ = synthetic_batch(np.random.default_rng(0), 1, batch, seq, s.model_config.vocab_size, 1, 1)
    batch_dev = place_batch(s, host)
    hlo = steady_state(s.train_step).lower(s.trainable, s.frozen, s.opt_state, batch_dev,
                                           jax.random.key(0)).compile().as_text()
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
    p.add_argument("--forms", default="direct,qdq,qdq+noexcess,qdq+notriton",
                   help="SUROJAX_FP8_DOT forms to compile, check and time (ops part); the first is the step's; "
                        "+noexcess / +notriton compile that variant with an XLA option (XLA_VARIANTS)")
    p.add_argument("--mkn", default="16384,1024,3072", help="M,K,N of the op benchmark (default: 0.6B gate/up)")
    args = p.parse_args()
    if args.smoke:
        args.shape, args.batch, args.seq, args.mkn, args.mode = "debug", 2, 64, "64,64,128", "both"
    M, K, N = (int(v) for v in args.mkn.split(","))
    unroll = True if args.unroll == "all" else int(args.unroll)
    print(f"devices: {jax.devices()}; jax {jax.__version__}", file=sys.stderr)
    rows: list = []
    forms = args.forms.split(",")
    ops_fp8, ops_ok = part_ops(rows, M, K, N, args.iters, timing=not args.smoke, forms=forms)  # never exits early
    step_fp8 = {m: part_step(rows, args.shape, m, args.batch, args.seq, unroll, time_steps=not args.smoke
                             and not args.no_step_time)
                for m in (("lora", "full") if args.mode == "both" else (args.mode,))}

    print("\n| part | variant | ms | GEMMs (kind: count) | fp8 used | max rel err (bound) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") is not None else "-"
        gemms = ", ".join(f"{k}: {v}" for k, v in sorted(r["gemms"].items())) or "-"
        if "tokens_per_s" in r:
            gemms = f"{r['tokens_per_s']:,.0f} tok/s, loss {r['loss']:.4f}"
        err = (f"{r['max_rel_err']:.4f} ({r['bound']:.4f}) {r['check']}" if "max_rel_err" in r else "-")
        print(f"| {r['part']} | {r['variant']} | {ms} | {gemms} | {r['fp8_gemms_used']} | {err} |")
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
    print("OPS CHECK: " + "; ".join(f"[{f}] {'OK' if v else 'FAIL'}" for f, v in ops_ok.items()))
    print("FP8 GEMMS USED: " + "; ".join(f"ops [{f}] {'yes' if u else 'NO'}" for f, u in ops_fp8.items())
          + "; " + "; ".join(f"step {m} [{forms[0]}] {'yes' if u else 'NO'}" for m, u in step_fp8.items()))
    return 0 if all(ops_ok.values()) else 1  # after every part has run and printed


if __name__ == "__main__":
    sys.exit(main())
