"""Where a decode step's time goes: the serving runner's jitted decode calls timed alone (no scheduler, no HTTP).

    python benchmarks/decode_step_h200.py                          # H200: qwen3-0.6b bf16, users 1 and 64
    python benchmarks/decode_step_h200.py --check-only             # H200: only the teacher-forced check
    python benchmarks/decode_step_h200.py --no-check               # H200: only the timing
    python benchmarks/decode_step_h200.py --smoke                  # CPU: debug shape, tiny lengths
    python benchmarks/decode_step_h200.py --smoke --dtype bf16 --check-only   # CPU: the check with a bf16 floor
    XLA_FLAGS=... python benchmarks/decode_step_h200.py --tag cmdbuf   # the same under other XLA flags

For each (rows R, variant) it builds the arrays the runner would (a pool holding R contexts of --context tokens,
block size 16, slots scattered over the pool as after real traffic) and times

  single         ``kv_reference.reference_step``: one token per row per call (K = 1), the reference gather/scatter
                 path
  multi          ``kv_reference.reference_multi_step_decode``: --steps tokens per row per call (one host sync per
                 call)
  single-paged   ``kv_paged.paged_step``: the paged path (``PagedKVCache``: the pool rides in the layer
                 loop, each layer reads its context through the block tables and writes its new k/v in place)
  multi-paged    ``multi_step.multi_step_decode_paged``: the same over --steps tokens per call
  single-reduce, multi-reduce   the paged path with ``PagedKernel.REDUCE``: the gather feeds a multiply + reduce
                 attention that XLA can fuse it into (no materialised gather, if XLA does)
  single-pallas, multi-pallas   the paged path with ``PagedKernel.PALLAS``: decode attention in the Pallas paged
                 decode-attention kernel (``pallas_kernels/paged_decode/``), which reads each row's real
                 blocks in place (no per-layer gather, no S padding)

each with the layer loop rolled (``-rolled``, ``unroll=1``) or inlined (``-unrolled``, ``unroll=True``); the
reference variants with ``kv_in_place`` on. First, per R, a correctness check that decides
(``benchmarks/decode_check.py``, teacher-forced): the same pool and the same inputs through the reference
arithmetic in fp32 (the truth: fp32 copies of weights and pool), the reference in the model's dtype (its error
is the bf16 noise floor) and each paged path (gather, and reduce / pallas where --variants names them): each
layer's attention sublayer alone (``attention_check``), then the whole model over --steps forced tokens (no
sampled token fed back; ``teacher_forced_check``: logits and the k/v written). The check's rows hold different
lengths (``check_lengths``: the full context, 0, 1, block edges ...). A path PASSES when every row's
max |diff| / max |truth| is at most 2 x the floor + --eps (at every step / layer), no other pool slot
changed, and its argmax equals the truth's wherever the truth's top-2 margin exceeds twice the allowed
error (`CHECK {...}` lines, a `CHECK-SUMMARY` line last). It reports, it does not stop. A
variant that fails (e.g. the kernel does not compile) prints `FAILED` and
the others go on. Reports ms per
token step (call time / tokens per row) and the decode tok/s it implies (R / that), then, with --profile, the
device kernels of one multi-step call by category (jax.profiler): what is GEMM, attention, copies, the rest,
and how many kernels a token step launches. One JSON line per measurement (`RESULT {...}`), a table last.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from surojax.bench.quant_base import randomize_base  # noqa: E402
from surojax.bench.shapes import model_config  # noqa: E402
from surojax.models.decoder import Decoder  # noqa: E402
from surojax.generation.sampling import BatchMode  # noqa: E402
from surojax.models.kv import PagedKernel  # noqa: E402
from surojax.quant.laid_out import decode_weights  # noqa: E402
from surojax.serve.input_batch import InputBatch, StepSettings  # noqa: E402
from surojax.serve.kv_reference import reference_multi_step_decode, reference_step  # noqa: E402
from surojax.serve.multi_step import multi_step_decode_paged  # noqa: E402
from surojax.serve.runner import paged_step  # noqa: E402

from decode_check import DEFAULT_EPS, attention_check, format_check, teacher_forced_check  # noqa: E402
from kernel_categories import category as kernel_category  # noqa: E402  (benchmarks/ is sys.path[0])

CATEGORIES = [  # first match wins, by substring of the kernel name (lower case)
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "wgmma", "cublas")),
    ("attention / softmax", ("softmax", "reduce", "cudnn", "fmha", "paged_decode")),
    ("copy / gather / scatter", ("copy", "transpose", "memcpy", "memset", "dynamic_update_slice",
                                 "dynamic_slice", "gather", "scatter")),
    ("fusion (elementwise)", ("fusion", "loop_", "input_")),
]


def category(name: str) -> str:
    return kernel_category(name, CATEGORIES)


def make_inputs(cfg, R, context, K, block_size, num_blocks, rng):
    """Arrays of one decode call: each row holds `context` tokens in randomly placed blocks of the pool."""
    per_row = -(-(context + K) // block_size)
    perm = rng.permutation(num_blocks)[: R * per_row].reshape(R, per_row)
    S = -(-(context + K) // 256) * 256
    ctx = np.zeros((R, S), np.int32)
    write = np.zeros((R, K), np.int32)
    for r in range(R):
        slots = perm[r][np.arange(context + K) // block_size] * block_size + np.arange(context + K) % block_size
        ctx[r, :context] = slots[:context]
        write[r] = slots[context:]
    tokens = rng.integers(1, cfg.vocab_size, R).astype(np.int32)
    rows = dict(temperature=np.zeros(R, np.float32), top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
                min_p=np.zeros(R, np.float32), seed=np.zeros(R, np.uint32), step=np.full(R, context, np.int32))
    table = np.zeros((R, S // block_size), np.int32)
    table[:, :per_row] = perm
    return tokens, ctx, write, table, rows


def check_lengths(R, context, block_size):
    """Tokens already in the pool per row for the check: row 0 the full context, the others cycle through
    the lengths where a paged kernel goes wrong (empty, one token, block and loop-iteration boundaries)."""
    bs = block_size
    edges = [0, 1, bs - 1, bs, bs + 1, 4 * bs - 1, 4 * bs, 4 * bs + 1, 100, 255, 256, 257, context // 2, context - 1]
    others = sorted({n for n in edges if 0 <= n < context})
    return np.array([context] + [others[(r - 1) % len(others)] for r in range(1, R)], np.int32)


def check(R, graphdef, state, pools, tokens, start, table, block_size, kernels: str, eps: float):
    """The teacher-forced checks (``benchmarks/decode_check.py``): each layer's attention sublayer alone
    (``attention_check``), then the whole model over the forced tokens [R, K] (``teacher_forced_check``),
    the same pool for the reference (bf16 and fp32) and each paged path (gather, and reduce / pallas where
    `kernels` names them); `CHECK {...}` lines with pass True / False. -> the result dicts."""
    paths = ["gather"] + [k for k in ("reduce", "pallas") if k in kernels]

    def failed(path, e):
        print(f"FAILED check {path} R={R}: {type(e).__name__}: {str(e)[:400]}", flush=True)

    results = []
    for fn, kw in ((attention_check, {}), (teacher_forced_check, {"tokens": tokens})):
        try:
            results += fn(graphdef, state, pools["k"], pools["v"], start=start, block_table=table,
                          block_size=block_size, paths=paths, eps=eps, on_error=failed, **kw)
        except Exception as e:  # noqa: BLE001 - the reference itself failed: report, keep the timing
            failed(f"{fn.__name__} reference", e)
    for r in results:
        print("CHECK " + json.dumps(r), flush=True)
        print("# " + format_check(r), flush=True)
    return results


def timed(fn, repeats):
    out = fn()
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t)
    return best, out


def profile_call(fn, steps_per_call, label, out_dir):
    trace_dir = Path("/tmp/surojax-decode-trace") / label
    shutil.rmtree(trace_dir, ignore_errors=True)
    jax.block_until_ready(fn())
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        jax.block_until_ready(fn())
    files = glob.glob(str(trace_dir / "**" / "*.trace.json.gz"), recursive=True)
    if not files:
        return None
    with gzip.open(files[0], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"]: e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in pids.items() if "GPU" in name.upper()}
    by_cat, by_name, n, total, first, last = collections.Counter(), collections.Counter(), 0, 0.0, None, None
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
            d = float(e["dur"])
            by_cat[category(e["name"])] += d
            by_name[e["name"]] += d
            total += d
            n += 1
            ts = float(e["ts"])
            first = ts if first is None else min(first, ts)
            last = ts + d if last is None else max(last, ts + d)
    span = (last - first) if first is not None else 0.0
    prof = {"kernels_per_token": n / steps_per_call, "busy_ms_per_token": total / 1e3 / steps_per_call,
            "span_ms_per_token": span / 1e3 / steps_per_call,
            **{f"{c}_ms_per_token": d / 1e3 / steps_per_call for c, d in by_cat.items()}}
    print(f"# profile {label}: {n} kernels, busy {total / 1e3:.2f} ms of a {span / 1e3:.2f} ms span "
          f"({steps_per_call} token steps)")
    for c, d in by_cat.most_common():
        print(f"#   {c:26s} {d / 1e3 / steps_per_call:7.3f} ms/token")
    for name, d in by_name.most_common(8):
        print(f"#   {d / 1e3 / steps_per_call:7.3f}  {name[:110]}")
    if out_dir and os.path.getsize(files[0]) < 8 * 2**20:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(files[0], Path(out_dir) / f"decode-{label}.json.gz")
    return prof


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--rows", default="1,64", help="comma list of decode batch sizes R")
    p.add_argument("--context", type=int, default=576, help="tokens already in each row's cache")
    p.add_argument("--steps", type=int, default=8, help="tokens per multi-step call")
    p.add_argument("--variants", default="multi-rolled,multi-paged-rolled,multi-reduce-rolled,multi-pallas-rolled,"
                   "single-rolled,single-paged-rolled,single-pallas-rolled",
                   help="comma list of {single,multi}[-paged|-reduce|-pallas]-{rolled,unrolled}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="kernel breakdown of the multi-step variants")
    p.add_argument("--tag", default="", help="a label for this process's XLA flags, printed in every row")
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--eps", type=float, default=DEFAULT_EPS,
                   help="the check's relative slack over twice the bf16 noise floor")
    p.add_argument("--check-only", action="store_true", help="the correctness check, no timing")
    p.add_argument("--no-check", action="store_true", help="the timing, no correctness check")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weights, compute and pool dtype (auto: bf16 on the GPU, fp32 elsewhere)")
    p.add_argument("--quant", default=None, help="a quantised base: every Linear of the layers in this format "
                   "(random codes; q4_k, q8_0, nf4, ...); SUROJAX_QUANT_MATMUL picks XLA or the fused decode GEMV")
    p.add_argument("--smoke", action="store_true", help="CPU: debug shape, tiny lengths")
    p.add_argument("--separate-projections", action="store_true",
                   help="keep q / k / v and gate / up as separate GEMMs (the server joins them: fused_projections)")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.rows, a.context, a.steps, a.repeats = "debug", "1,4", 40, 4, 1
    cfg = model_config(a.shape)
    dtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32}.get(
        a.dtype, jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    model = Decoder(cfg, dtype=dtype, param_dtype=dtype, attention="xla", rngs=nnx.Rngs(0))
    if a.quant:
        randomize_base(model, a.quant, jax.random.key(1))
    # as surojax serve: the weights the decode kernel takes laid out once, q / k / v and gate / up joined
    laid = decode_weights(model, join_projections=not a.separate_projections)
    graphdef, state = nnx.split(model)
    bs = 16
    rows_list = [int(r) for r in a.rows.split(",")]
    K = a.steps
    num_blocks = max(rows_list) * (-(-(a.context + K) // bs)) + 8
    shape = (cfg.num_layers, num_blocks * bs, cfg.num_kv_heads, cfg.head_dim)
    keys = jax.random.split(jax.random.key(0))  # random contexts: the correctness check reads them
    pools = {"k": jax.random.normal(keys[0], shape, dtype), "v": jax.random.normal(keys[1], shape, dtype)}
    greedy = BatchMode(sample=False, penalties=False, logprobs=False)
    print(f"# {a.shape} {jnp.dtype(dtype).name}{' base ' + a.quant if a.quant else ''} on "
          f"{jax.devices()[0].device_kind}; context {a.context}, K {K}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"SUROJAX_QUANT_MATMUL={os.environ.get('SUROJAX_QUANT_MATMUL', 'auto')}, decode kernel layouts: "
          f"{laid or 'none'}", flush=True)
    results = []
    for R in rows_list:
        tokens, ctx, write, table, rows = make_inputs(cfg, R, a.context, K, bs, num_blocks, np.random.default_rng(R))
        start = np.full(R, a.context, np.int32)
        limit, no_stop, zeros = np.full(R, K, np.int32), np.full((R, 1), -1, np.int32), np.zeros(R, np.int32)

        def multi(paged, unroll, kernel="gather", tokens=tokens, ctx=ctx, write=write, table=table, rows=rows,
                  start=start, limit=limit, no_stop=no_stop, zeros=zeros):
            batch = dict(tokens=tokens, start=start, limit=limit, stop_ids=no_stop, adapter_rows=zeros, sampling=rows)
            settings = StepSettings(block_size=bs, mode=greedy, num_steps=K, unroll=unroll)
            if paged:
                return multi_step_decode_paged(graphdef, state, pools["k"], pools["v"],
                                               InputBatch(block_table=table, **batch),
                                               dataclasses.replace(settings, kernel=PagedKernel(kernel)))
            return reference_multi_step_decode(graphdef, state, pools["k"], pools["v"],
                                               InputBatch(ctx_slots=ctx, write_slots=write, **batch),
                                               dataclasses.replace(settings, kv_in_place=True))

        forced = np.random.default_rng(1000 + R).integers(1, cfg.vocab_size, (R, K)).astype(np.int32)
        if not a.no_check:
            results += check(R, graphdef, state, pools, forced, check_lengths(R, a.context, bs), table, bs,
                             a.variants, a.eps)
        for variant in ([] if a.check_only else a.variants.split(",")):
            parts = variant.split("-")
            kind, loop = parts[0], parts[-1]
            kernel = next((x for x in ("pallas", "reduce") if x in parts[1:-1]), "gather")
            paged = kernel != "gather" or "paged" in parts[1:-1]
            unroll = True if loop == "unrolled" else 1
            if kind == "single":
                n = 1
                pos = np.full((R, 1), a.context, np.int32)

                def fn(unroll=unroll, paged=paged, kernel=kernel, tokens=tokens, ctx=ctx, write=write, table=table,
                       rows=rows, pos=pos, start=start, zeros=zeros):
                    common = dict(tokens=tokens[:, None], positions=pos, segment_ids=np.ones((R, 1), np.int32),
                                  start=start, last_idx=zeros, adapter_rows=zeros, sampling=rows)
                    settings = StepSettings(block_size=bs, mode=greedy, unroll=unroll)
                    if paged:
                        k, v, out = paged_step(graphdef, state, pools["k"], pools["v"],
                                               InputBatch(block_table=table, **common),
                                               dataclasses.replace(settings, kernel=PagedKernel(kernel)))
                    else:
                        k, v, out = reference_step(graphdef, state, pools["k"], pools["v"],
                                                   InputBatch(ctx_slots=ctx, write_slots=write[:, :1], **common),
                                                   dataclasses.replace(settings, kv_in_place=True))
                    pools["k"], pools["v"] = k, v
                    return out["ids"]
            else:
                n = K

                def fn(unroll=unroll, paged=paged, kernel=kernel):
                    k, v, out = multi(paged, unroll, kernel)
                    pools["k"], pools["v"] = k, v
                    return out["ids"]
            t0 = time.perf_counter()
            try:
                jax.block_until_ready(fn())
                compile_s = time.perf_counter() - t0
                best, ids = timed(fn, a.repeats)
            except Exception as e:  # noqa: BLE001 - report, keep the other variants
                print(f"FAILED {variant} R={R}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                if pools["k"].is_deleted() or pools["v"].is_deleted():  # donated to the failed call
                    pools["k"], pools["v"] = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
                continue
            ms = 1e3 * best / n
            r = {"tag": a.tag, "rows": R, "variant": variant, "ms_per_token_step": ms, "decode_tok_s": R / ms * 1e3,
                 "compile_s": compile_s, "context": a.context, "steps_per_call": n}
            if a.profile and kind == "multi":
                r.update(profile_call(fn, n, f"{a.tag or 'default'}-R{R}-{variant}", a.out) or {})
            results.append(r)
            print("RESULT " + json.dumps(r), flush=True)
    print("\n| tag | R | variant | ms / token step | decode tok/s | compile s | kernels / token | busy ms / token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("check"):
            continue
        print(f"| {r['tag'] or 'default'} | {r['rows']} | {r['variant']} | {r['ms_per_token_step']:.3f} | "
              f"{r['decode_tok_s']:,.0f} | {r['compile_s']:.1f} | {r.get('kernels_per_token', float('nan')):.0f} | "
              f"{r.get('busy_ms_per_token', float('nan')):.3f} |")
    checks = [r for r in results if r.get("check")]
    print("\ncorrectness (teacher-forced, each path vs the fp32 reference, same pool, same inputs: each layer's "
          "attention alone, then the model over forced tokens; pass = err <= 2 x the bf16 reference's err + eps "
          "per row, no stray writes, decisive argmax equal):")
    for r in checks:
        print("  " + format_check(r))
    verdicts = [r for r in checks if r["check"] not in ("reference", "attention-gather")]
    print("CHECK-SUMMARY " + json.dumps({r["check"] + f"-R{r['rows']}": "PASS" if r["pass"] else "FAIL"
                                        for r in verdicts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
