"""Is `recipe: fp8_hybrid` faster than bf16 on the H200? One job: bf16 vs fp8_hybrid with current / delayed /
blockwise scaling on three 8B workloads (issue 19's targets: >= 1.3x bf16 tok/s on full fine-tuning and
pretraining shapes, >= 1.1x on LoRA).

    workloads   qwen3-8b-full   Qwen3-8B full fine-tune (adamw_8bit, optimizer_layerwise: fp32 master + 8-bit
                                moments fit one H200 with the in-place per-layer update)
                qwen3-8b-lora   Qwen3-8B LoRA r16 all-linear (bf16 base)
                llama3-8b-pt    Llama-3-8B pretraining shapes (full, adamw_8bit)
    variants    bf16 | fp8-current | fp8-delayed | fp8-blockwise

Every variant is the `surojax bench train` build (the trainer's build path: build_model applies the recipe);
seq 4096, batch 1, recompute full. The step is compiled once (`lower().compile()`); its HLO is read for FP8
GEMMs (benchmarks/fp8_gemm_check.gemm_census: `__cublas$lt$matmul$f8` custom calls, Triton GEMMs or dots on f8
operands), then timed: `warmup` steps, `repeats` x `steps` steps, median. Output: one JSON line per variant on
stdout (tokens/s, step ms, MFU against 731 TFLOP/s bf16 dense, peak GiB, the GEMM census, fp8_gemms: bool,
speed-up over bf16 of the same workload), then a table on stderr. A variant that fails (out of memory, a refused
config) prints a JSON line with its error and the job goes on. blockwise is an emulation (bf16 GEMMs on
exactly-quantised operands, docs/precision.md): expect it slower than bf16 and no FP8 GEMMs.

    PYTHONPATH=$PWD python benchmarks/campaigns/fp8_h200.py                          # H200, all 12 variants
    PYTHONPATH=$PWD python benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-lora --variants bf16 fp8-delayed
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/campaigns/fp8_h200.py --smoke    # CPU plumbing: debug shape
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: fp8_gemm_check
from fp8_gemm_check import fp8_used, gemm_census  # noqa: E402

from surojax.bench.flops import PEAK_BF16_FLOPS, flop_targets, step_flops  # noqa: E402
from surojax.bench.train_bench import BenchConfig, _peak_gib, build, place_batch, synthetic_batch  # noqa: E402
from surojax.precision.fp8_matmul import accumulation, dot_form, wgrad_form  # noqa: E402
from surojax.precision.fp8_scaling import cast_form  # noqa: E402
from surojax.train.step import steady_state  # noqa: E402

WORKLOADS = {
    "qwen3-8b-full": dict(shape="qwen3-8b", mode="full", optimizer="adamw_8bit", optimizer_layerwise=True),
    "qwen3-8b-lora": dict(shape="qwen3-8b", mode="lora"),
    "llama3-8b-pt": dict(shape="llama3-8b", mode="full", optimizer="adamw_8bit", optimizer_layerwise=True),
}
VARIANTS = {
    "bf16": dict(recipe="bf16"),
    "fp8-current": dict(recipe="fp8_hybrid", fp8_scaling="current"),
    "fp8-delayed": dict(recipe="fp8_hybrid", fp8_scaling="delayed"),
    "fp8-blockwise": dict(recipe="fp8_hybrid", fp8_scaling="blockwise"),
}
COMMON = dict(batch=1, seq=4096, recompute="full", segments=4, min_segment=256)
SMOKE = dict(shape="debug", batch=1, seq=64, recompute="none", segments=2, min_segment=16, optimizer="adamw")


def measure(bc: BenchConfig, steps: int, warmup: int, repeats: int) -> dict:
    """Build, compile once, census the HLO, time the compiled step."""
    device = jax.devices()[0]
    setup = build(bc, device=device)
    host, lengths = synthetic_batch(np.random.default_rng(bc.seed), bc.accum, bc.batch, bc.seq,
                                    setup.model_config.vocab_size, bc.segments, bc.min_segment)
    batch, key = place_batch(setup, host), jax.random.key(bc.seed)
    state = [setup.trainable, setup.opt_state]
    t0 = time.perf_counter()
    # the steady-state program (fp8_scaling: delayed compiles a separate first step; its warm-up fills the histories)
    compiled = steady_state(setup.train_step).lower(state[0], setup.frozen, state[1], batch, key).compile()
    compile_s = time.perf_counter() - t0
    census = gemm_census(compiled.as_text())

    def one():
        state[0], state[1], m = compiled(state[0], setup.frozen, state[1], batch, key)
        return m

    metrics = None
    for _ in range(1 + warmup):
        metrics = one()
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            metrics = one()
        jax.block_until_ready((state, metrics))
        times.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(times)
    tokens = bc.accum * bc.batch * bc.seq
    fl = step_flops(setup.model_config, mode=bc.mode, tokens=tokens, segment_lengths=lengths, rank=bc.rank,
                    targets=flop_targets(setup.model_config, bc.targets))
    return {"tokens_per_s": tokens / step_s, "step_ms": step_s * 1e3, "step_ms_repeats": [t * 1e3 for t in times],
            "mfu": fl["total"] / step_s / PEAK_BF16_FLOPS, "peak_gib": _peak_gib(device), "compile_s": compile_s,
            "loss": float(metrics["loss"]), "gemm_census": census, "fp8_gemms": fp8_used(census),
            "device": device.device_kind, "jax": jax.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check: the debug shape, 1 step")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.repeats = 1, 0, 1
    rows, bf16 = [], {}
    for wl in args.workloads:
        for var in args.variants:
            keys = {**COMMON, **WORKLOADS[wl], **VARIANTS[var], **(SMOKE if args.smoke else {})}
            bc = BenchConfig(**keys)
            record = {"bench": "fp8_h200", "workload": wl, "variant": var,
                      "config": {k: v for k, v in dataclasses.asdict(bc).items() if k in keys},
                      # SUROJAX_FP8_DOT / _CAST / _ACCUM / _WGRAD
                      "fp8_forms": {"dot": dot_form(), "cast": cast_form(), "accum": accumulation(),
                                    "wgrad": wgrad_form()}}
            try:
                record.update(measure(bc, args.steps, args.warmup, args.repeats))
                if var == "bf16":
                    bf16[wl] = record["tokens_per_s"]
                if wl in bf16:
                    record["speedup_vs_bf16"] = record["tokens_per_s"] / bf16[wl]
            except Exception as e:  # noqa: BLE001 - one variant's failure (OOM, refusal) must not stop the job
                record["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc(file=sys.stderr)
            print(json.dumps(record), flush=True)
            rows.append(record)
            jax.clear_caches()
    print(f"\n{'workload':16} {'variant':14} {'tok/s':>10} {'x bf16':>7} {'MFU':>6} {'peak GiB':>9} {'FP8 GEMMs':>9}",
          file=sys.stderr)
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:16} {r['variant']:14} error: {r['error'][:60]}", file=sys.stderr)
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"{r['workload']:16} {r['variant']:14} {r['tokens_per_s']:10.0f} {r.get('speedup_vs_bf16', 0):7.3f} "
              f"{r['mfu']:6.1%} {peak:>9} {str(r['fp8_gemms']):>9}", file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
