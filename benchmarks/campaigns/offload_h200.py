"""Training models larger than the GPU on one H200 (issue 6): LoRA over a base streamed from pinned host memory.

    python3 benchmarks/campaigns/offload_h200.py                       # every configuration (each in its own process)
    python3 benchmarks/campaigns/offload_h200.py --only llama8b-resident,llama8b-streamed
    JAX_PLATFORMS=cpu python3 benchmarks/campaigns/offload_h200.py --smoke     # the plumbing on a CPU, tiny shapes

Each configuration runs `surojax bench train`'s own code (surojax/bench/train_bench.py: the trainer's
build_model / optimizer / make_train_step on synthetic packed batches) in a fresh process, so its peak device
memory (peak_bytes_in_use) is its own. Random weights are built on the host and placed straight where they live
(surojax/offload/host_init.py): the streamed base in pinned host memory, never whole on the device.

Configurations (seq 2048, recompute full, LoRA r16 on all linear layers, bf16 recipe; lmhead_chunks 8 = 256-token
chunks at batch 1; the memory plan estimates 4.0 GiB for llama8b-streamed):
    llama8b-resident      Llama-3.1-8B shapes, bf16 base on the device                   (baseline)
    llama8b-streamed      the same, base streamed from host       target: peak <= 4 GiB, step <= 1.3x resident
    llama8b-resident-b4 / llama8b-streamed-b4   the pair at batch 4 (the copy is amortised over 4x the compute)
    llama8b-streamed-b4-unroll2 / -unrolled / -pipelined / -db   the batch-4 streamed run with 2 layers per loop
                          iteration / every layer inlined / XLA's pipelined host offloading / while-loop double
                          buffering: does XLA then fetch layer l+1 while layer l computes?
    llama8b-streamed-prefetch / -b4-prefetch   the streamed pair with offload_prefetch: the copy of
                          layer l+1 issued explicitly during layer l (forward and backward recompute); at batch 4
                          the floor is ~1.0x if the copies hide fully, at batch 1 ~3.1x (copies > compute)
    exact-resident / exact-streamed   the protocol on the GPU: deterministic GEMM algorithms
                          (--xla_gpu_deterministic_ops --xla_gpu_autotune_level=0), all losses equal;
                          exact-streamed-prefetch: the same for the prefetching loop
    qwen32b-streamed      Qwen3-32B shapes, bf16 base (~61 GiB) streamed from the 128 GiB host
    llama70b-q4-streamed  Llama-3-70B shapes, Q4_0 base (~37 GiB) streamed              (bf16 would not fit)
    qwen8b-full-offload-opt  Qwen3-8B shapes, FULL fine-tuning, fp32 master weights, AdamW state of the layers in
                          pinned host memory (61 GiB), updated one layer at a time
    qwen8b-full-adamw8bit Qwen3-8B shapes, FULL fine-tuning, fp32 master weights, adamw_8bit moments, resident
    qwen8b-full-offload-opt-master  Qwen3-8B shapes, FULL fine-tuning, AdamW state AND fp32 master weights of the
                          layers in pinned host memory (~78 GiB), the device training their bf16 copy; the memory
                          plan estimates 57 GiB peak (qwen8b-full-offload-opt: 82 GiB; all resident: 159 GiB).
                          Both update in place, one layer at a time (surojax/offload/optimizer.py `in_place`; XLA's
                          CPU buffer assignment of the same program scaled from 4 and 8 layers: 58 / 84 GiB, of
                          which ~10 GiB is a CPU-only broadcast; before: 160 / 177 GiB and a second 51.75 GiB host
                          buffer for the new moments). `python -m surojax.bench.step_memory` prints those figures
Correctness: a streamed run and its resident pair start from the same host-built weights. Their first-step losses
must be EQUAL; later losses are reported (measured 2026-11-29: equal first loss, 4th-digit drift after 5 steps,
where autotuning may pick different GEMM algorithms for the two compiled programs). The `exact-*` pair runs with
deterministic algorithm choice and must have ALL losses equal (the protocol's 0.0). Else: MISMATCH, exit 1.

Output: one JSON line per measurement (the bench record plus "name"), then a table (tokens/s, step ms, peak
device GiB, host GiB, ratio to the resident pair, targets). Environment: XLA_FLAGS (default: latency-hiding
scheduler on), XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.95), per-configuration timeout --timeout (240 s).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
GiB = 2 ** 30

from surojax.offload.host_memory import ENV as HOST_LIMIT_ENV  # noqa: E402  (no jax import)
from surojax.offload.host_memory import limit_for, total_ram_gb  # noqa: E402

DETERMINISTIC = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
COMMON = dict(mode="lora", seq=2048, rank=16, recompute="full", recipe="bf16", init="host", warmup=1)
CONFIGS: dict[str, dict] = {
    "llama8b-resident": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=5, repeats=2),
    "llama8b-streamed": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=5, repeats=2, offload_base=True),
    "llama8b-resident-b4": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2),
    "llama8b-streamed-b4": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2,
                                offload_base=True),
    # batch 4, where the copies (~550 ms per step) could hide behind the compute (~650 ms) if layer l+1 were
    # fetched during layer l; measured 2026-11-29: 1.70x, i.e. XLA runs them serially. Ways to let XLA overlap:
    # unrolled layer loops (the copy of the second layer of an iteration is independent of the first's compute)
    # and XLA's host-offload pipelining / while-loop double buffering flags
    "llama8b-streamed-b4-unroll2": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2,
                                        offload_base=True, unroll_layers=2),
    "llama8b-streamed-b4-unrolled": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2,
                                         offload_base=True, unroll_layers=True),
    "llama8b-streamed-b4-pipelined": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2,
                                          offload_base=True,
                                          xla_extra="--xla_gpu_enable_pipelined_host_offloading=true"),
    "llama8b-streamed-b4-db": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2,
                                   offload_base=True,
                                   xla_extra="--xla_gpu_enable_while_loop_double_buffering=true"),
    # offload_prefetch (surojax/offload/prefetch.py): a double-buffered layer loop issues the copy of layer l+1
    # explicitly during layer l's compute, forward and backward recompute (2 layers' weights on the device)
    "llama8b-streamed-prefetch": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=5, repeats=2,
                                      offload_base=True, prefetch=True),
    "llama8b-streamed-b4-prefetch": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2,
                                         offload_base=True, prefetch=True),
    # since 2026-11-29 (session 4) offload_prefetch keeps the base as per-layer host buffers (HostLayers) and runs
    # an unrolled per-layer loop (whole-buffer copies: asynchronous DMA XLA overlaps; benchmarks/host_copy_overlap.py).
    # Its resident twin: the same program with the base on the device (the protocol's pair; also a timing floor)
    "llama8b-resident-twin": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=5, repeats=2, prefetch=True),
    "llama8b-resident-b4-twin": dict(shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2,
                                     prefetch=True),
    # the copies were measured serialised with the compute (1.83x with prefetch, 2026-11-29): XLA's async-copy
    # knobs (host offloading pass, no size floor for async copies, selective memcpy overlap), all at once
    "llama8b-streamed-b4-prefetch-async": dict(
        shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2, offload_base=True, prefetch=True,
        xla_extra="--xla_gpu_enable_host_memory_offloading=true --xla_gpu_async_copy_min_bytes=0 "
                  "--xla_gpu_experimental_enable_selective_memcpy_overlap=true"),
    "llama8b-streamed-b4-async": dict(
        shape="llama3-8b", batch=4, lmhead_chunks=16, steps=3, repeats=2, offload_base=True,
        xla_extra="--xla_gpu_enable_host_memory_offloading=true --xla_gpu_async_copy_min_bytes=0 "
                  "--xla_gpu_experimental_enable_selective_memcpy_overlap=true"),
    # the exactness protocol on the GPU: the same weights resident and streamed, XLA's GEMM algorithm choice made
    # deterministic (autotuning picks per compiled program, so two programs may pick different cuBLAS algorithms);
    # the losses of 4 optimizer steps (which depend on every LoRA gradient) must be equal bit for bit
    "exact-resident": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=2, repeats=1,
                           xla_extra=DETERMINISTIC),
    "exact-streamed": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=2, repeats=1, offload_base=True,
                           xla_extra=DETERMINISTIC),
    "exact-streamed-prefetch": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=2, repeats=1,
                                    offload_base=True, prefetch=True, xla_extra=DETERMINISTIC),
    "exact-resident-twin": dict(shape="llama3-8b", batch=1, lmhead_chunks=8, steps=2, repeats=1, prefetch=True,
                                xla_extra=DETERMINISTIC),
    "qwen32b-streamed": dict(shape="qwen3-32b", batch=1, lmhead_chunks=4, steps=2, repeats=2, offload_base=True),
    "llama70b-q4-streamed": dict(shape="llama3-70b", batch=1, lmhead_chunks=4, steps=2, repeats=2,
                                 offload_base=True, base_format="q4_0"),
    # full fine-tuning of Qwen3-8B shapes on one H200: fp32 master weights + fp32 gradients (~98 GiB) leave no
    # room for fp32 AdamW moments (66 GiB): offload them (updated per layer), or keep 8-bit moments (16 GiB)
    "qwen8b-full-offload-opt": dict(shape="qwen3-8b", mode="full", batch=1, lmhead_chunks=4, steps=3, repeats=2,
                                    offload_optimizer=True, init="jit"),
    # + offload_master: the layers' fp32 master in host memory too, bf16 copy on the device (per-layer update)
    "qwen8b-full-offload-opt-master": dict(shape="qwen3-8b", mode="full", batch=1, lmhead_chunks=4, steps=3,
                                           repeats=2, offload_optimizer=True, offload_master=True, init="jit"),
    "qwen8b-full-adamw8bit": dict(shape="qwen3-8b", mode="full", batch=1, lmhead_chunks=4, steps=3, repeats=2,
                                  optimizer="adamw_8bit", init="jit"),
}
# streamed run -> (its resident pair, loss check): "exact" all losses equal; "first" the first loss equal (later
# ones reported); None: timing only (an unrolled loop compiles to other fusions: not the same numerics)
PAIRS = {"llama8b-streamed": ("llama8b-resident", "first"), "llama8b-streamed-b4": ("llama8b-resident-b4", "first"),
         "llama8b-streamed-b4-unroll2": ("llama8b-resident-b4", None),
         "llama8b-streamed-b4-unrolled": ("llama8b-resident-b4", None),
         "llama8b-streamed-b4-pipelined": ("llama8b-resident-b4", "first"),
         "llama8b-streamed-b4-db": ("llama8b-resident-b4", "first"),
         "exact-streamed": ("exact-resident", "exact"),
         "llama8b-streamed-prefetch": ("llama8b-resident-twin", "first"),
         "llama8b-streamed-b4-prefetch": ("llama8b-resident-b4-twin", "first"),
         "exact-streamed-prefetch": ("exact-resident-twin", "exact"),
         "llama8b-streamed-b4-prefetch-async": ("llama8b-resident-b4", "first"),
         "llama8b-streamed-b4-async": ("llama8b-resident-b4", "first"),
         # the same weights, the bf16 copy made once instead of at each use: the first loss must be equal
         "qwen8b-full-offload-opt-master": ("qwen8b-full-offload-opt", "first")}
# the ratio that the ≤ 1.3x target is about: to the plain resident step (the twin is the same unrolled program)
ALSO_VS = {"llama8b-streamed-prefetch": "llama8b-resident", "llama8b-streamed-b4-prefetch": "llama8b-resident-b4"}
TARGETS = {"llama8b-streamed": {"peak_gib": 4.0, "ratio": 1.3},
           "llama8b-streamed-prefetch": {"peak_gib": 4.0, "ratio": 1.3},
           "llama8b-streamed-b4-prefetch": {"ratio": 1.3}}
SMOKE = dict(shape="debug", seq=128, min_segment=16, lmhead_chunks=1, steps=1, repeats=1, warmup=1)


def child(spec: str) -> int:
    """Run one configuration in this process and print its record (the last stdout line)."""
    from surojax.bench.train_bench import BenchConfig, run

    cfg = json.loads(spec)
    name = cfg.pop("name")
    record = run(BenchConfig(**cfg))
    record["name"] = name
    print(json.dumps(record), flush=True)
    return 0


def run_config(name: str, cfg: dict, timeout: float) -> dict:
    cfg = dict(cfg)
    extra = cfg.pop("xla_extra", "")
    spec = json.dumps({"name": name, **cfg})
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    if extra and not os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {extra}".strip()
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    ram = total_ram_gb()  # XLA caps pinned host memory at 64 GB; the 32B base and 8B moments need more
    if ram:
        env.setdefault(HOST_LIMIT_ENV, str(limit_for(ram)))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"name": name, "error": f"timed out after {timeout:.0f} s", "stderr_tail": tail}
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"name": name, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    record = json.loads(lines[-1])
    record["wall_s"] = wall
    return record


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated names (default all): {', '.join(CONFIGS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and 1 step each (CPU plumbing check)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration (default 240)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)}; known: {', '.join(CONFIGS)}")

    records: dict[str, dict] = {}
    for name in names:
        cfg = {**COMMON, **CONFIGS[name], **(SMOKE if args.smoke else {})}
        print(f"[offload_h200] {name}: {json.dumps(cfg)}", file=sys.stderr, flush=True)
        rec = run_config(name, cfg, args.timeout)
        records[name] = rec
        if "error" in rec:
            print(f"[offload_h200] {name} FAILED: {rec['error']}\n{rec.get('stderr_tail', '')}", file=sys.stderr,
                  flush=True)
        print(json.dumps(rec), flush=True)

    failed = False
    rows = []
    for name, rec in records.items():
        if "error" in rec:
            rows.append((name, "-", "-", "-", "-", "-", "-", "ERROR: " + rec["error"]))
            failed = True
            continue
        ratio, notes = None, []
        pair_name, check = PAIRS.get(name, ("", None))
        pair = records.get(pair_name, {})
        if "step_ms" in pair:
            ratio = rec["step_ms"] / pair["step_ms"]
            first_equal = rec["loss_first"] == pair["loss_first"]
            last_equal = rec["loss"] == pair["loss"]
            if check is None:
                ok = True
                notes.append(f"vs {pair_name} (timing only)")
            elif check == "exact":
                ok = first_equal and last_equal
                notes.append("all losses equal (exact)" if ok else f"MISMATCH losses {rec['loss_first']!r}, "
                             f"{rec['loss']!r} vs {pair['loss_first']!r}, {pair['loss']!r}")
            else:
                ok = first_equal
                drift = abs(rec["loss"] - pair["loss"]) / max(abs(pair["loss"]), 1e-30)
                notes.append(("first loss equal" if ok else
                              f"MISMATCH first loss {rec['loss_first']!r} vs {pair['loss_first']!r}")
                             + ("; last equal" if last_equal else f"; last differs by {drift:.1e} (rel)"))
            failed |= not ok
        also = records.get(ALSO_VS.get(name, ""), {})
        if "step_ms" in also:
            notes.append(f"x {ALSO_VS[name]}: {rec['step_ms'] / also['step_ms']:.2f}")
        if rec.get("config", {}).get("offload_optimizer") or rec.get("config", {}).get("offload_master"):
            notes.append(f"plan {fmt(rec.get('plan_gib'), '.1f')} GiB")  # the memory plan's estimate of the peak
        for key, limit in TARGETS.get(name, {}).items():
            value = (rec["step_ms"] / also["step_ms"] if "step_ms" in also else ratio) if key == "ratio" \
                else rec.get(key)
            if value is not None and not args.smoke:
                notes.append(f"{key} {value:.2f} {'<=' if value <= limit else 'ABOVE'} target {limit}")
        rows.append((name, fmt(rec["tokens_per_s"], ",.0f"), fmt(rec["step_ms"], ".0f"), fmt(rec["peak_gib"], ".2f"),
                     fmt(rec.get("host_gib"), ".1f"), fmt(ratio, ".2f"), fmt(rec.get("compile_s"), ".0f"),
                     "; ".join(notes)))
    head = ("config", "tok/s", "step ms", "peak GiB", "host GiB", "x resident", "compile s", "check")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print()
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
