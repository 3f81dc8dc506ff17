"""Profile the training step on the GPU (jax.profiler) and print where the device time goes.

    python benchmarks/profile_step.py --shape qwen3-0.6b --mode lora [--recompute none] [--out DIR]
    python benchmarks/profile_step.py --shape llama3-8b --batch 4 --recompute full --lmhead-chunks 16 \
        --offload-base --init host [--prefetch]          # where the streamed base's copies wait (issue 6)
    python benchmarks/profile_step.py --shape qwen3-30b-a3b --mode lora --batch 2 --seq 2048 --recompute full \
        --parallel expert=2,data=1                       # over every visible GPU: the expert exchange's NCCL time
Prints the top kernels by device time per step and GPU (over several GPUs: the mean of theirs), grouped by a coarse
category (NCCL collectives first), one `PROFILE {json}` line of the categories, and copies
the perfetto trace (trace.json.gz) to --out when it is small enough to bring back. Then the timeline: per GPU
stream (trace thread) its busy time, and how much of the host-to-device copy time runs while a compute kernel
runs on another stream (overlap), against the wall time of a step.
"""
import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from surojax.bench.train_bench import BenchConfig, build, place_batch, synthetic_batch  # noqa: E402
from surojax.cli.bench import mesh_sizes_arg  # noqa: E402
from surojax.parallel import batch_parallel_size  # noqa: E402
from surojax.train.step import steady_state  # noqa: E402

from hlo_attribution import attribute, instruction_sources  # noqa: E402  (benchmarks/ is sys.path[0])
from kernel_categories import category as kernel_category  # noqa: E402
from trace_intervals import overlap, union  # noqa: E402
from trace_summary import gpu_kernels, kernel_sums, trace_file  # noqa: E402

CATEGORIES = [  # first match wins, by substring of the kernel name (lower case)
    ("collectives (NCCL)", ("nccl", "all-gather", "all_gather", "allgather", "reduce-scatter", "reduce_scatter",
                            "all-reduce", "all_reduce", "allreduce", "all-to-all", "alltoall", "collective-permute")),
    ("attention (cuDNN)", ("cudnn", "flash", "fmha", "sdpa")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "triton_gemm", "matmul", "wgmma")),
    ("loss / softmax", ("reduce", "logsumexp")),
    ("copy / transpose", ("copy", "transpose", "memcpy", "memset", "dynamic_update_slice", "dynamic_slice")),
    ("fusion (elementwise)", ("fusion", "loop_", "input_")),
]


def category(name: str) -> str:
    return kernel_category(name, CATEGORIES)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--mode", default="lora")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--recompute", default="none")
    p.add_argument("--attention", default="auto")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--unroll-layers", default="1", help="1 (rolled layer scan) or all (every layer inlined)")
    p.add_argument("--lmhead-chunks", type=int, default=1)
    p.add_argument("--offload-base", action="store_true", help="LoRA base streamed from pinned host memory")
    p.add_argument("--prefetch", action="store_true", help="with --offload-base: offload_prefetch")
    p.add_argument("--init", default="jit", help="jit | host (random weights placed from the host)")
    p.add_argument("--optimizer", default="adamw", help="adamw | adamw_8bit")
    p.add_argument("--optimizer-layerwise", action="store_true", help="full: the in-place per-layer update")
    p.add_argument("--recipe", default="bf16", help="bf16 | fp8_hybrid | nvfp4")
    p.add_argument("--fp8-scaling", default=None,
                   help="with --recipe fp8_hybrid: current | delayed | blockwise (default: the config's, delayed)")
    p.add_argument("--parallel", type=mesh_sizes_arg, default=None, metavar="AXIS=N,...",
                   help="the config's parallel: the step over a mesh of every visible device (e.g. expert=2,data=1)")
    p.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3), help="the config's zero_stage")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/surojax-profile"))
    p.add_argument("--attribute", action="store_true",
                   help="also print the kernel time by source line (dumps the optimized HLO: hlo_attribution.py)")
    a = p.parse_args()
    dump_dir = None
    if a.attribute:  # before the backend starts: XLA reads its flags once
        dump_dir = tempfile.mkdtemp(prefix="surojax-hlo-")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*").strip()
    bc = BenchConfig(shape=a.shape, mode=a.mode, batch=a.batch, seq=a.seq, recompute=a.recompute,
                     attention=a.attention, lmhead_chunks=a.lmhead_chunks, offload_base=a.offload_base,
                     prefetch=a.prefetch, init=a.init, optimizer=a.optimizer,
                     optimizer_layerwise=a.optimizer_layerwise, recipe=a.recipe, fp8_scaling=a.fp8_scaling,
                     unroll_layers=True if a.unroll_layers == "all" else int(a.unroll_layers),
                     parallel=a.parallel, zero_stage=a.zero_stage)
    setup = build(bc)
    rows = a.batch * batch_parallel_size(setup.mesh)  # --batch per data shard, as `surojax bench train` counts it
    host, _ = synthetic_batch(np.random.default_rng(0), 1, rows, a.seq, setup.model_config.vocab_size, 4, 64)
    batch = place_batch(setup, host)
    key = jax.random.key(0)
    tr, st = setup.trainable, setup.opt_state
    step = steady_state(setup.train_step)  # fp8_scaling: delayed: its history program (no separate first step)
    for _ in range(3):
        tr, st, m = step(tr, setup.frozen, st, batch, key)
    jax.block_until_ready(m)
    trace_dir = Path(tempfile.mkdtemp(prefix="surojax-trace-"))  # one per process: runs may share a machine
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(a.steps):
            tr, st, m = step(tr, setup.frozen, st, batch, key)
        jax.block_until_ready(m)
    path = trace_file(trace_dir)
    if path is None:
        print("no perfetto trace found under", trace_dir, os.listdir(trace_dir))
        return 1
    kernels, events, gpu_pids = gpu_kernels(path)
    by_name, by_cat, total, devices = kernel_sums(kernels, divide=a.steps, category=category)
    print(f"device time per step and GPU (sum of kernel durations, mean over {devices} GPU(s)): {total / 1e3:.1f} ms "
          f"over {len(by_name)} kernels")
    for cat, d in by_cat.most_common():
        print(f"  {cat:24s} {d / 1e3:8.1f} ms  {100 * d / max(total, 1):5.1f}%")
    print("PROFILE " + json.dumps({"gpus": devices, "kernel_ms": total / 1e3,
                                   "categories_ms": {c: d / 1e3 for c, d in by_cat.items()}}), flush=True)
    print("top kernels (ms per step):")
    for name, d in by_name.most_common(40):
        print(f"  {d / 1e3:8.2f}  {name[:150]}")
    timeline(events, gpu_pids, a.steps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if dump_dir is not None:
        dumps = sorted(glob.glob(f"{dump_dir}/*after_optimizations.txt"), key=os.path.getsize)
        if not dumps:
            print("no optimized HLO dump under", dump_dir)
        else:
            print(attribute(kernels, instruction_sources(Path(dumps[-1]).read_text()), a.steps))
            with open(dumps[-1], "rb") as src, gzip.open(out / f"hlo-{a.shape}-{a.mode}-{a.recipe}.txt.gz",
                                                         "wb") as dst:
                shutil.copyfileobj(src, dst)  # the optimized HLO the attribution read
    if os.path.getsize(path) < 15 * 2**20:
        shutil.copy(path, out / f"trace-{a.shape}-{a.mode}.json.gz")
    return 0


def is_copy(name: str) -> bool:
    n = name.lower()
    return "memcpy" in n and not any(k in n for k in ("dtod", "d2d", "memcpy128", "memcpy32", "memcpy64"))


def timeline(events, gpu_pids, steps: int) -> None:
    """Per stream: busy ms per step; host<->device copies: ms per step and the part that overlaps compute."""
    kern = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    if not kern:
        return
    tids = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    t0 = min(float(e["ts"]) for e in kern)
    t1 = max(float(e["ts"]) + float(e["dur"]) for e in kern)
    print(f"timeline: {(t1 - t0) / 1e3 / steps:.1f} ms wall per step (first kernel to last, {steps} steps)")
    by_stream = collections.defaultdict(list)
    for e in kern:
        by_stream[(e["pid"], e.get("tid"))].append(e)
    streams = sorted(by_stream.items(), key=lambda kv: -sum(float(e["dur"]) for e in kv[1]))
    if len(streams) > 8:
        rest = sum(float(e["dur"]) for _, evs in streams[8:] for e in evs)
        print(f"  ({len(streams)} streams; the 8 busiest below, the other {len(streams) - 8} together "
              f"{rest / 1e3 / steps:.1f} ms/step of kernels)")
    for key, evs in streams[:8]:
        busy = sum(iv[1] - iv[0] for iv in union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]))
        copies = sum(float(e["dur"]) for e in evs if is_copy(e["name"]))
        print(f"  stream {tids.get(key, key)!s:40.40s} busy {busy / 1e3 / steps:8.1f} ms/step, {len(evs) // steps} "
              f"events/step, host copies {copies / 1e3 / steps:7.1f} ms/step")
    compute = union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kern if not is_copy(e["name"])])
    cps = [e for e in kern if is_copy(e["name"])]
    if not cps:
        print("  no host<->device copies in the trace")
        return
    total = sum(float(e["dur"]) for e in cps)
    hidden = sum(overlap(float(e["ts"]), float(e["ts"]) + float(e["dur"]), compute) for e in cps)
    names = collections.Counter(e["name"][:60] for e in cps)
    print(f"  host<->device copies: {total / 1e3 / steps:.1f} ms/step, {len(cps) // steps} per step, "
          f"{100 * hidden / total:.1f}% of their time overlaps a compute kernel; kinds: {dict(names.most_common(4))}")


if __name__ == "__main__":
    sys.exit(main())
