"""Which JAX formulation makes XLA overlap host->device weight copies with compute (H200)?

    python3 benchmarks/host_copy_overlap.py                    # L=8 layers of [4096, 14336] bf16, T=8192
    python3 benchmarks/host_copy_overlap.py --profile          # + a jax.profiler trace per variant (streams)
    python3 benchmarks/host_copy_overlap.py --only resident,list-unrolled --xla-flags "--xla_foo=true"
    JAX_PLATFORMS=cpu python3 benchmarks/host_copy_overlap.py --smoke   # the plumbing on a CPU, tiny shapes

Why: surojax streams a frozen base from pinned host memory one layer at a time inside a `lax.scan`
(surojax/offload/streaming.py, prefetch.py). A trace of the Llama-3.1-8B batch-4 step showed the copies are
`wrapped_dynamic_slice_*` kernels on the compute stream (reading pinned host memory over PCIe), not DMA
transfers, so step = compute + copies. This script isolates the question on a toy layer loop:

    weights   W_l [D, F] bf16, l < L (default one 8B MLP matrix per layer, ~117 MB)
    layer     y = x @ W_l  [T, F];  x = (y @ W_l^T) * sqrt(D / F)  [T, D]       (4 T D F flops per layer)

and runs it in these forms (the same numbers; every variant is checked against `resident`):

    resident              W stacked [L, D, F] on the device, lax.scan                   (the compute floor)
    copy-only             stacked in host memory, scan: device_put(W[l]) then sum it      (the transfer floor)
    copy-only-list        L separate host arrays, unrolled: device_put(W_l) whole, sum    (transfer floor, whole)
    scan-dynamic-slice    scan over the host stack: w = device_put(slice, Device)         (surojax today)
    scan-prefetch         scan carrying layer l+1's device copy while computing layer l   (offload_prefetch)
    scan-prefetch-unroll2 the same, scan(unroll=2)                  (jax's overlap test: "needed for double buffering")
    list-unrolled         L separate host arrays, Python-unrolled loop in jit, put of l+1 issued before layer l
    stacked-unrolled      list-unrolled over static slices W[l] of the host stack (what `unroll_layers: all` gives
                          surojax: no dynamic index, the same stacked parameters)
    scan-switch-prefetch  scan-prefetch whose fetch is lax.switch over L whole-buffer device_puts (a rolled loop
                          that still copies whole buffers)
    eager-pipelined       no loop in jit: a jitted layer per call, the next layer's whole buffer put to the device
                          eagerly by the runtime (PJRT's own host->device DMA) before the layer is dispatched
  experimental APIs, run last (an XLA check failure aborts the process; the JSON lines before it are printed):
    gpu-stream-prefetch   scan-prefetch whose fetch runs under compute_on('gpu_stream:1') (XLA stream annotation:
                          the copy on a second stream)
    list-unrolled-gpu-stream  list-unrolled, each whole-buffer device_put under compute_on('gpu_stream:1')
    compute-on-host-slice scan-prefetch whose slice runs under compute_on('device_host') (stays in host memory),
                          then a whole-buffer device_put                        (error reported if it does not lower)

Per variant: ms per call (median of --iters after warm-up), the ratio to `resident`, its transfer floor
(copy-only or copy-only-list), max abs difference to `resident` (check: exact / close / FAIL), and op counts of
the compiled HLO (copy-start, dynamic-slice, async starts). With --profile, from a jax.profiler trace: the number of
MemcpyH2D events per call and their ms, whether they run on another stream than the compute kernels, the % of
their time that overlaps a compute kernel, and the same for kernels named *dynamic_slice* (the non-DMA copies).
Output: one JSON line per variant, then a table. Reading it: ms ~ serial = resident + floor means serial copies;
ms ~ ideal (a two-stage pipeline: ~max(resident, floor) + 1/L of the other) means full overlap (hidden% 100).
Environment: XLA_FLAGS gets the latency-hiding scheduler (as offload_h200.py) unless it names it, then
--xla-flags (XLA reads flags once per process); --skip NAME,... leaves out a variant that aborts.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the shared trace helpers
from trace_intervals import overlap, union  # noqa: E402

H2D_BANDWIDTH_GBPS = 50.0      # pinned host -> H200 over PCIe 5 x16, as measured for surojax's streaming
BF16_TFLOPS = 700.0            # a realistic dense bf16 GEMM rate on the H200 (peak 989)
LHS_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="L")
    p.add_argument("--d", type=int, default=4096, help="D (model width)")
    p.add_argument("--f", type=int, default=14336, help="F (MLP width)")
    p.add_argument("--tokens", type=int, default=8192, help="T (rows of x): sets compute per layer")
    p.add_argument("--iters", type=int, default=10, help="timed calls per variant (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated variants (resident always runs)")
    p.add_argument("--skip", default="", help="comma-separated variants not to run (e.g. one that aborts)")
    p.add_argument("--profile", action="store_true", help="a jax.profiler trace per variant")
    p.add_argument("--profile-iters", type=int, default=3)
    p.add_argument("--out", default="", help="write each variant's optimised HLO (hlo-VARIANT.txt) and, with "
                   "--profile, its trace (trace-VARIANT.json.gz, when < 15 MB) here")
    p.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before jax starts")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): L=3, D=64, F=128, T=32")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.d, a.f, a.tokens, a.iters, a.warmup = 3, 64, 128, 32, 2, 1
        a.profile_iters = 1
    return a


# ----------------------------------------------------------------------------------------------- the variants


def build_variants(jax, jnp, num_layers: int, scale: float) -> dict[str, Callable]:
    """{name: make(x, w_dev, w_host, ws_host) -> (call(x) -> out, optimised HLO text or None)}."""
    lax = jax.lax
    Device = jax.memory.Space.Device

    def layer(x, w):                                   # x [T, D], w [D, F]
        y = jnp.dot(x, w)                              # [T, F]
        return (jnp.dot(y, w.T) * scale).astype(x.dtype)   # [T, D]

    def fetch(w_host, index):                          # host stack [L, D, F] -> layer `index` on the device
        return jax.device_put(lax.dynamic_index_in_dim(w_host, index, keepdims=False), Device)

    def total(w):                                      # a reduction that reads every element of the copy
        return jnp.sum(w, dtype=jnp.float32)

    def prefetch_loop(fetch_fn, unroll=1):
        def run(x, w_host):
            def step(carry, l):
                x, w = carry
                w_next = fetch_fn(w_host, jnp.minimum(l + 1, num_layers - 1))   # independent of x
                return (layer(x, w), w_next), None
            (x, _), _ = lax.scan(step, (x, fetch_fn(w_host, 0)), jnp.arange(num_layers), unroll=unroll)
            return x
        return run

    def jitted(fn, args_of):
        def make(x, w_dev, w_host, ws):               # compiled once; the HLO text for the census
            args = args_of(w_dev, w_host, ws)
            compiled = jax.jit(fn).lower(x, *args).compile()
            return (lambda x: compiled(x, *args)), compiled.as_text()
        return make

    def resident(x, w_dev):
        return lax.scan(lambda x, w: (layer(x, w), None), x, w_dev)[0]

    def copy_only(x, w_host):
        def step(acc, w_l):
            return acc + total(jax.device_put(w_l, Device)), None
        return lax.scan(step, jnp.zeros((), jnp.float32), w_host)[0]

    def copy_only_list(x, *ws):
        return sum((total(jax.device_put(w, Device)) for w in ws), jnp.zeros((), jnp.float32))

    def scan_dynamic_slice(x, w_host):
        return lax.scan(lambda x, w_l: (layer(x, jax.device_put(w_l, Device)), None), x, w_host)[0]

    def list_unrolled_with(put):
        def run(x, *ws):
            w_next = put(ws[0])
            for l in range(num_layers):
                w = w_next
                if l + 1 < num_layers:
                    w_next = put(ws[l + 1])                  # issued before layer l's compute
                x = layer(x, w)
            return x
        return run

    def stacked_unrolled(x, w_host):                   # static slices of the stack (scan(unroll=True) form)
        return list_unrolled_with(lambda w: jax.device_put(w, Device))(x, *(w_host[l] for l in range(num_layers)))

    def on_stream_1(fn):
        from jax.experimental.compute_on import compute_on
        return compute_on(compute_type="gpu_stream:1", out_memory_spaces=Device)(fn)

    def host_slice_fetch(w_host, index):
        from jax.experimental.compute_on import compute_on
        slice_on_host = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
            lambda a, i: lax.dynamic_index_in_dim(a, i, keepdims=False))
        return jax.device_put(slice_on_host(w_host, index), Device)

    def gpu_stream_fetch(w_host, index):
        return on_stream_1(fetch)(w_host, index)

    def switch_prefetch(x, *ws):
        branches = [lambda i=i: jax.device_put(ws[i], Device) for i in range(num_layers)]

        def step(carry, l):
            x, w = carry
            w_next = lax.switch(jnp.minimum(l + 1, num_layers - 1), branches)
            return (layer(x, w), w_next), None
        (x, _), _ = lax.scan(step, (x, jax.device_put(ws[0], Device)), jnp.arange(num_layers))
        return x

    def eager_pipelined(x, w_dev, w_host, ws):
        one = jax.jit(layer)

        def call(x):
            w_next = jax.device_put(ws[0], Device)
            for l in range(num_layers):
                w = w_next
                if l + 1 < num_layers:
                    w_next = jax.device_put(ws[l + 1], Device)   # the runtime's async host->device copy
                x = one(x, w)
            return x
        return call, None

    stacked = lambda w_dev, w_host, ws: (w_host,)          # noqa: E731
    listed = lambda w_dev, w_host, ws: tuple(ws)           # noqa: E731
    return {
        "resident": jitted(resident, lambda w_dev, w_host, ws: (w_dev,)),
        "copy-only": jitted(copy_only, stacked),
        "copy-only-list": jitted(copy_only_list, listed),
        "scan-dynamic-slice": jitted(scan_dynamic_slice, stacked),
        "scan-prefetch": jitted(prefetch_loop(fetch), stacked),
        "scan-prefetch-unroll2": jitted(prefetch_loop(fetch, unroll=2), stacked),
        "list-unrolled": jitted(list_unrolled_with(lambda w: jax.device_put(w, Device)), listed),
        "stacked-unrolled": jitted(stacked_unrolled, stacked),
        "scan-switch-prefetch": jitted(switch_prefetch, listed),
        "eager-pipelined": eager_pipelined,
        # experimental APIs last: a variant that aborts the process (an XLA check failure) leaves the lines above
        "gpu-stream-prefetch": jitted(prefetch_loop(gpu_stream_fetch), stacked),
        "list-unrolled-gpu-stream": jitted(list_unrolled_with(on_stream_1(lambda w: jax.device_put(w, Device))),
                                           listed),
        "compute-on-host-slice": jitted(prefetch_loop(host_slice_fetch), stacked),
    }


# what each variant's result is compared with, and its transfer floor
REFERENCE = {"copy-only": "copy-sums", "copy-only-list": "copy-sums"}
FLOOR = {name: "copy-only-list" for name in ("copy-only-list", "list-unrolled", "list-unrolled-gpu-stream",
                                             "stacked-unrolled", "scan-switch-prefetch", "eager-pipelined")}


# ------------------------------------------------------------------------------------------------- the trace


def is_h2d(name: str) -> bool:
    n = name.lower()
    return "memcpyh2d" in n or "htod" in n or ("memcpy" in n and "h2d" in n)


def is_dynamic_slice(name: str) -> bool:
    n = name.lower()
    return "dynamic_slice" in n or "dynamic-slice" in n


SUMMARY_ROWS = ("XLA Ops", "XLA Modules", "Steps", "TensorFlow", "Framework")


def analyse_trace(events: list[dict], calls: int) -> dict:
    """Per call: MemcpyH2D count / ms / streams / % overlapping compute kernels; the same for dynamic-slice
    kernels (copies done by a kernel); compute-kernel ms; wall from the first device event to the last."""
    pids = {e["pid"]: e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in pids.items() if "/device:gpu" in name.lower()}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    evs = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
    rows = collections.Counter(threads.get((e["pid"], e.get("tid")), str(e.get("tid"))) for e in evs)
    stream_rows = {k for k, v in threads.items() if k[0] in gpu and v.lower().startswith("stream")}
    if stream_rows:                     # keep the CUDA stream rows (not the "XLA Ops" / "XLA Modules" summaries)
        evs = [e for e in evs if (e["pid"], e.get("tid")) in stream_rows]
    else:
        evs = [e for e in evs if not threads.get((e["pid"], e.get("tid")), "").startswith(SUMMARY_ROWS)]
    out = dict(device_events=len(evs))
    if not evs:
        return out
    iv = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))   # noqa: E731  (microseconds)
    stream = lambda e: threads.get((e["pid"], e.get("tid")), str(e.get("tid")))   # noqa: E731
    copy_row = lambda e: is_h2d(stream(e)) and "compute" not in stream(e).lower()   # noqa: E731
    # an event on a row of host-to-device copies only ("Stream #14(MemcpyH2D)") is one, whatever its name
    evs = [dict(e, name=f"MemcpyH2D:{e['name']}") if copy_row(e) and not is_h2d(e["name"]) else e for e in evs]
    h2d = [e for e in evs if is_h2d(e["name"])]
    dsl = [e for e in evs if is_dynamic_slice(e["name"])]
    other_copies = [e for e in evs if "memcpy" in e["name"].lower() and not is_h2d(e["name"])]   # D2D, D2H
    compute = [e for e in evs if not is_h2d(e["name"]) and not is_dynamic_slice(e["name"])
               and "memcpy" not in e["name"].lower() and "memset" not in e["name"].lower()]
    merged = union([iv(e) for e in compute])
    compute_streams = collections.Counter(stream(e) for e in compute)

    def summary(kind, group):
        ms = sum(float(e["dur"]) for e in group) / 1e3
        hidden = sum(overlap(*iv(e), merged) for e in group) / 1e3
        streams = sorted({stream(e) for e in group})
        return {f"{kind}_per_call": len(group) / calls, f"{kind}_ms": ms / calls,
                f"{kind}_overlap_pct": 100.0 * hidden / ms if ms else 0.0, f"{kind}_streams": streams,
                f"{kind}_other_stream": bool(streams) and not set(streams) & set(compute_streams)}

    t0 = min(iv(e)[0] for e in evs)
    t1 = max(iv(e)[1] for e in evs)
    out.update(summary("h2d", h2d))
    out.update(summary("dslice", dsl))
    out.update(compute_ms=sum(float(e["dur"]) for e in compute) / 1e3 / calls,
               compute_streams=dict(compute_streams.most_common(4)), wall_ms=(t1 - t0) / 1e3 / calls,
               other_memcpy_per_call=len(other_copies) / calls,
               other_memcpy_ms=sum(float(e["dur"]) for e in other_copies) / 1e3 / calls,
               device_rows=dict(rows.most_common(8)),
               h2d_names=dict(collections.Counter(e["name"][:50] for e in h2d).most_common(3)),
               dslice_names=dict(collections.Counter(e["name"][:50] for e in dsl).most_common(3)))
    return out


def profile(jax, call, x, calls: int, name: str, keep: str) -> dict:
    trace_dir = Path(tempfile.mkdtemp(prefix=f"host-copy-{name}-"))
    try:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(calls):
                out = call(x)
            jax.block_until_ready(out)
        files = glob.glob(str(trace_dir / "**" / "*.trace.json.gz"), recursive=True)
        if not files:
            return {"profile_error": f"no perfetto trace under {trace_dir}"}
        with gzip.open(files[0], "rt") as f:
            trace = json.load(f)
        if keep and os.path.getsize(files[0]) < 15 * 2**20:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(files[0], Path(keep) / f"trace-{name}.json.gz")
        return analyse_trace(trace["traceEvents"] if isinstance(trace, dict) else trace, calls)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- the run


def hlo_census(compiled_text: str) -> dict:
    """Op counts of the optimised HLO: async copies between memory spaces (copy-start), dynamic slices (kernels
    unless emitted as a dynamic memcpy), async wrappers (a call / fusion on another stream), host layouts."""
    t = compiled_text
    return {"hlo_copy_start": t.count("copy-start("), "hlo_dynamic_slice": t.count("dynamic-slice("),
            "hlo_dynamic_memcpy": t.count("__dynamic_memcpy"),
            "hlo_async_start": sum(t.count(k) for k in ("call-start(", "fusion-start(", "async-start(")),
            "hlo_stream_annotation": t.count("_xla_stream_annotation"), "hlo_host_layout_S5": t.count("S(5)")}


def timed(jax, call, x, warmup: int, iters: int) -> tuple[float, object]:
    for _ in range(warmup):
        out = jax.block_until_ready(call(x))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out = jax.block_until_ready(call(x))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), out


def check(diff: float, ref_scale: float) -> str:
    if diff == 0.0:
        return "exact"
    return "close" if diff <= 2e-2 * max(ref_scale, 1e-30) else "FAIL"


def derive(rec: dict, results: dict[str, dict]) -> None:
    """Ratios of one variant to the resident loop and to its transfer floor (both run before it)."""
    name = rec["variant"]
    base = results.get("resident", {}).get("ms")
    floor = results.get(FLOOR.get(name, "copy-only"), {}).get("ms")
    rec.update(floor_ms=floor, x_resident=rec["ms"] / base if base and "ms" in rec else None)
    if base and floor and "ms" in rec and name not in ("resident", "copy-only", "copy-only-list"):
        num_layers = rec.get("layers") or results["resident"]["layers"]
        copy, compute = floor / num_layers, base / num_layers
        rec["serial_ms"] = base + floor                  # compute then copies, nothing hidden
        # a two-stage pipeline: the first copy and the last layer's compute cannot be hidden
        rec["ideal_ms"] = copy + compute + (num_layers - 1) * max(copy, compute)
        if rec["serial_ms"] > rec["ideal_ms"]:
            rec["hidden_pct"] = 100.0 * (rec["serial_ms"] - rec["ms"]) / (rec["serial_ms"] - rec["ideal_ms"])


def main(argv=None) -> list[dict]:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if not a.smoke and "latency_hiding_scheduler" not in flags + a.xla_flags:
        flags = f"{flags} {LHS_FLAG}"          # as surojax's GPU benchmarks run (offload_h200.py)
    os.environ["XLA_FLAGS"] = f"{flags} {a.xla_flags}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from surojax.offload.streaming import OffloadError, host_memory_kind

    dev = jax.devices()[0]
    try:
        host_kind = host_memory_kind(dev)      # pinned_host (jax's CPU backend has one too)
    except OffloadError:                       # a backend without it: any host memory, for the plumbing
        host_kinds = [m.kind for m in dev.addressable_memories() if "host" in m.kind]
        if not host_kinds:
            raise
        host_kind = host_kinds[0]
    L, D, F, T = a.layers, a.d, a.f, a.tokens
    scale = math.sqrt(D / F)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (T, D), jnp.bfloat16)                               # [T, D]
    w_dev = (jax.random.normal(kw, (L, D, F), jnp.float32) / math.sqrt(D)).astype(jnp.bfloat16)  # [L, D, F]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind=host_kind)
    w_host = jax.device_put(w_dev, host)                                          # [L, D, F] in host memory
    ws_host = [jax.device_put(w_dev[l], host) for l in range(L)]                  # L x [D, F], separate buffers
    jax.block_until_ready((x, w_dev, w_host, ws_host))
    layer_bytes = D * F * 2
    layer_flops = 4 * T * D * F
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; L={L} D={D} F={F} "
          f"T={T}; host memory kind {host_kind!r} ({w_host.sharding.memory_kind}); XLA_FLAGS="
          f"{os.environ.get('XLA_FLAGS', '')!r}")
    print(f"# per layer: {layer_bytes / 1e6:.1f} MB copied (~{layer_bytes / H2D_BANDWIDTH_GBPS / 1e6:.2f} ms at "
          f"{H2D_BANDWIDTH_GBPS:.0f} GB/s), {layer_flops / 1e12:.2f} TFLOP of compute (~"
          f"{layer_flops / BF16_TFLOPS / 1e9:.2f} ms at {BF16_TFLOPS:.0f} TFLOP/s)")

    variants = build_variants(jax, jnp, L, scale)
    names = list(variants)
    if a.only:
        wanted = {n.strip() for n in a.only.split(",") if n.strip()}
        unknown = wanted - set(names)
        if unknown:
            raise SystemExit(f"--only: unknown variants {sorted(unknown)}; known: {', '.join(names)}")
        names = [n for n in names if n == "resident" or n in wanted
                 or (n in ("copy-only", "copy-only-list") and any(FLOOR.get(w, "copy-only") == n for w in wanted))]

    # copy-only's reference: the same per-layer reductions of the device-resident stack
    skip = {n.strip() for n in a.skip.split(",") if n.strip()}
    names = [n for n in names if n not in skip or n == "resident"]
    copy_sums = jax.jit(lambda w: sum((jnp.sum(w[l], dtype=jnp.float32) for l in range(L)),
                                      jnp.zeros((), jnp.float32)))(w_dev)
    results: dict[str, dict] = {}
    ref_out = None
    for name in names:
        rec = {"variant": name}
        try:
            t0 = time.perf_counter()
            call, hlo = variants[name](x, w_dev, w_host, ws_host)
            out = jax.block_until_ready(call(x))
            rec["first_call_s"] = round(time.perf_counter() - t0, 3)        # compile + first call
            if hlo is not None:
                rec.update(hlo_census(hlo))
                if a.out:                                   # the optimised HLO, to read what XLA made of it
                    Path(a.out).mkdir(parents=True, exist_ok=True)
                    (Path(a.out) / f"hlo-{name}.txt").write_text(hlo)
            rec["ms"], out = timed(jax, call, x, a.warmup, a.iters)
            if name == "resident":
                ref_out = np.asarray(out, np.float32)
            if REFERENCE.get(name) == "copy-sums":
                ref, got = np.asarray(copy_sums), np.asarray(out, np.float32)
            else:
                ref, got = ref_out, np.asarray(out, np.float32)
            rec["max_abs_diff"] = float(np.max(np.abs(got - ref)))
            rec["check"] = check(rec["max_abs_diff"], float(np.max(np.abs(ref))))
            rec["out_memory_kind"] = getattr(getattr(out, "sharding", None), "memory_kind", None)
            if a.profile:
                rec.update(profile(jax, call, x, a.profile_iters, name, a.out))
        except Exception as e:  # noqa: BLE001 - a variant that does not lower / run is a result, not a crash
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rec["check"] = "error"
        results[name] = rec
        rec.update(layers=L, d=D, f=F, tokens=T, backend=jax.default_backend())
        derive(rec, results)
        print(json.dumps(rec, default=str), flush=True)   # now: a variant that aborts the process keeps these

    base = results.get("resident", {}).get("ms")
    if base:
        print(f"# per layer measured: compute {base / L:.2f} ms (resident), copy "
              f"{(results.get('copy-only', {}).get('ms') or float('nan')) / L:.2f} ms (copy-only), "
              f"{(results.get('copy-only-list', {}).get('ms') or float('nan')) / L:.2f} ms (copy-only-list)")
    print_table(results)
    return list(results.values())


def print_table(results: dict[str, dict]) -> None:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "-"
    head = (f"{'variant':24s} {'ms':>8s} {'x res':>6s} {'floor ms':>8s} {'serial':>8s} {'ideal':>8s} "
            f"{'hidden%':>7s} {'ovl%':>6s} {'#H2D':>5s} {'H2D ms':>7s} {'dsl ms':>7s} {'dsl ovl%':>8s} "
            f"{'cp-start':>8s} {'check':>6s}")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        print(f"{name:24s} {f(r.get('ms'), '8.2f')} {f(r.get('x_resident'), '6.2f')} {f(r.get('floor_ms'), '8.2f')} "
              f"{f(r.get('serial_ms'), '8.2f')} {f(r.get('ideal_ms'), '8.2f')} {f(r.get('hidden_pct'), '7.1f')} "
              f"{f(r.get('h2d_overlap_pct'), '6.1f')} {f(r.get('h2d_per_call'), '5.0f')} {f(r.get('h2d_ms'), '7.2f')} "
              f"{f(r.get('dslice_ms'), '7.2f')} {f(r.get('dslice_overlap_pct'), '8.1f')} "
              f"{f(r.get('hlo_copy_start'), '8d')} {r.get('check', '-'):>6s}"
              + (f"  {r['error'][:90]}" if "error" in r else ""))
    print("ms: median per call; floor: the transfer-only variant of the same copy form; serial = resident + floor; "
          "ideal: a 2-stage pipeline (first copy + last compute + (L-1) x max per layer); hidden%: (serial - ms) / "
          "(serial - ideal), 100 = ideal; ovl%: MemcpyH2D time "
          "overlapping compute kernels (--profile); dsl: *dynamic_slice* kernels (copies done by a kernel); "
          "cp-start: copy-start ops in the compiled HLO")


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any(r.get("check") == "FAIL" for r in res) else 0)
