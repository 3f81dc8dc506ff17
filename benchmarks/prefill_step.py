"""Where a serving prefill step's time goes: the runner's jitted prefill call timed alone (no scheduler, no HTTP).

    python benchmarks/prefill_step.py                                   # GPU: qwen3-0.6b bf16, the default cases
    python benchmarks/prefill_step.py --attention xla,cudnn --profile $OUT/prefill   # + kernels by category
    python benchmarks/prefill_step.py --smoke [--profile /tmp/p]        # CPU: debug shape, tiny lengths

Each case is a prefill group as the scheduler hands it to `PagedRunner.execute` (surojax/serve/runner.py):
``PxL`` = P prompts of L new tokens each, ``PxL+C`` = their chunk starts after C tokens already in the pool
(a continuing chunk or a prefix hit: C tokens are prefilled first, untimed), ``A&B`` = one step holding both
groups (``16x512&1x64``: the 64-user step of serve_load, 16 prompts plus a 64-token chunk of the 17th). The
model is built as `surojax serve` builds it (random weights of --shape, --attention backend, `decode_weights`:
q / k / v and gate / up joined), on a `PagedRunner` with the server's defaults (block size 16, kv path auto,
RunnerBuckets() unless --min-context), its pool filled with random values and the rows' blocks scattered over
it (a random permutation: as after real traffic). Timed per case, best of --repeats:

  call     the step's jitted calls alone (``runner.access.step``, `kv_paged.paged_step`; new prompts and
           continuing chunks are separate calls, runner.py `_call_groups`) on the batches the runner built (host
           numpy arrays: their host-to-device copy is part of it, as in the server)
  execute  ``runner.execute(group)``: the runner's host work (padding to buckets, sampling rows, waves) + the
           call + reading the sampled ids back: what one engine step pays beyond the scheduler

and reported with the padded shape [R, T] x S (R, T rounded up to powers of two; S the context bucket), the
share of padding, tokens/s, and the MFU of the real tokens' FLOPs (weights 2 x params x tokens; attention
4 x heads x head_dim x the keys each query sees, causal; the head on one row per prompt) against the card's
dense bf16 peak. First (--check, on by default) the first sampled token of every prompt is checked against a
plain forward (`Decoder.__call__` on context + prompt, xla attention): the top-20 logprobs the serving call
returns equal log_softmax of the plain logits within --tol (bf16: 0.1, fp32: 1e-3), `CHECK` lines.

--profile DIR: a jax.profiler trace of --profile-calls calls per case; each GPU kernel is attributed to the
source line that made it (the optimized HLO's metadata, benchmarks/hlo_attribution.py) and summed by category:

  matmul            the projections (linear.py / gemv_weight.py GEMMs: q|k|v, o, gate|up, down)
  attention         xla_attention's einsums + masked softmax, or cuDNN's fused kernel; the mask
  kv write          the scatter of the new k/v into the pool (kv/paged.py write)
  kv read           the per-layer gather of the rows' context from the pool (kv/paged.py read)
  kv metadata       slots, context mask and lengths (kv/paged.py step, once per call)
  norm/rope/elementwise   RMSNorms, rope, the SwiGLU product, residual adds, reshapes
  head              the logits (decoder.py logits: one row per prompt: `sampling.sample_last`)
  sampling          argmax / the sampler
  host->device      memcpy HtoD events (the batch's arrays)
  other             anything else (its top kernels are printed)

plus the calls' wall time against the union of their kernels (the host gaps). One `RESULT {...}` JSON line per
case and a table last.

What the code said before this branch, and what the branch changed (runner.py `_run` / `_call_groups`,
kv/paged.py `PagedLayerKV.update_and_attend`):
* The attention of a prefill on the paged pool writes the new k/v, gathers each row's whole context bucket S back
  out of the pool and runs the layer's DENSE attention with a [B, T, S] mask (kv/meta.py `AttendSpec.attend`).
  `surojax serve --attention` defaulted to xla then (`auto`, cuDNN on a GPU, since session 27; serve/config.py
  `ServeConfig.attention`): `xla_attention` (models/layers/attention.py) materialises fp32 scores
  [B, K, G, T, S] (16 x 512 prompts with serve_load's S = 768: 400 MB a layer, x 28 layers, written, transposed,
  soft-maxed, read again). cuDNN (--attention cudnn) runs the same dense mask as a flash kernel with a bf16 bias.
  CHANGED: a call whose rows all start at 0 (new prompts, no prefix hit) is `fresh`: it attends over its own
  k/v, nothing read back, S = T, cuDNN's packed causal kernel where the layer is cuDNN (--fresh on / off A/Bs it).
* Rows were bucketed to powers of two over every prefill row of a step: the 64-user step holds 16 whole prompts
  and a chunk of the 17th (serve_load's budget, users + 8192: prefill steps 0-2 have 17 rows, steps 1-3 one of them
  continuing a chunked prompt), so R = 17 -> 32 rows of T = 512: 16,384 token slots for ~8,250 real ones, and the
  continuing chunk made the whole call read the pool. CHANGED: new prompts and continuing chunks are separate
  calls (16 + 1 rows: case 15x512&1x112&1x448+64 is step 1). `RunnerBuckets.fine_prefill_rows` (off) rounds a
  prefill's rows to 2^k or 1.5 x 2^k (--fine-prefill-rows).
* The logits are computed for each prompt's last token only (`sampling.sample_last`), unless prompt logprobs
  are asked (`serve.prompt_logprobs`, blocks of 128 positions): not a cost.
* Prefill and decode rows of one step run as separate calls (runner.py `execute`): a step with 16 prompts and
  48 decodes reads the weights twice (~0.5 ms at 0.6B); with K-step decode the decode calls are one token each
  while a prompt waits (scheduler `_schedule_multi_step`). Per-request host work per step is O(rows + blocks):
  not a cost at these sizes (the `execute` - `call` column says).

Expected at 16x512 on an H100 (qwen3-0.6b bf16, 8,192 tokens, 8.6 TFLOP; serve_load's buckets, --min-context 648:
S = 768), fresh off (as before this branch), xla attention: matmul 11-13 ms (7.2 TFLOP at 550-650 TFLOP/s);
attention 25-35 ms (1.4 TFLOP of batched dots, plus the fp32 scores: ~2.5 GB a layer written, transposed and
soft-maxed, ~70 GB a call); kv write 0.5-1 ms (0.9 GB scattered); kv read ~1 ms (1.4 GB gathered); kv metadata,
head, sampling, host->device < 0.3 ms each; norm/rope/elementwise 4-5 ms (~400 MB a layer: the SwiGLU's
[8192, 6144] product, norms, rope, residuals); host gaps ~1 ms. ~50 ms in all, against the ~80 ms the 16-user
TTFT suggests: what the profile finds beyond that is the first thing to read. Fresh on (xla): attention x 2/3, no
kv read. cuDNN + fresh: attention 1-3 ms, the call ~20-25 ms (~35-40% MFU). The 64-user steps: fresh off 2x the
16x512 call (32 rows), with the split ~1.1x.

What to try next, in order of expected effect (each measurable with this script, then serve_load's TTFT):
1. `surojax serve --attention` auto (cuDNN on a GPU) by default, if the cudnn rows here pass the check and win:
   expected to remove most of the attention category, 16x512 from ~50-80 to ~20-25 ms; the 64-user TTFT p50
   from ~270 to ~100 ms (4 prefill steps of ~25 ms, plus the decodes between them).
2. `--attention cudnn:2:nocheck` for serving (the runner's rows are one run from position 0, then padding):
   drops the per-layer branch check (a predicate read per layer: host gaps).
3. `fine_prefill_rows` on, if compile counts allow (prefill R 17 -> 24 where a step still has 17 new rows).
4. then the GEMMs (MFU of the matmul category alone) and the host gaps; and decode rows riding in the prefill
   call (one weight read a step instead of two) only if the profile shows the second read matters.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from surojax.bench.shapes import model_config  # noqa: E402
from surojax.generation.sampling import MAX_TOP_LOGPROBS, SamplingParams  # noqa: E402
from surojax.models.decoder import Decoder  # noqa: E402
from surojax.models.layers.attention_backend import parse_attention_backend  # noqa: E402
from surojax.quant.laid_out import decode_weights  # noqa: E402
from surojax.serve.config import KVPath, RunnerBuckets  # noqa: E402
from surojax.serve.engine import resolve_kv_path  # noqa: E402
from surojax.serve.runner import PagedRunner  # noqa: E402
from surojax.serve.scheduler import Request, ScheduledRequest  # noqa: E402

from hlo_attribution import instruction_sources, kernel_source  # noqa: E402  (benchmarks/ is sys.path[0])
from kernel_categories import category as name_category  # noqa: E402
from trace_intervals import union  # noqa: E402
from trace_summary import gpu_kernels, trace_file  # noqa: E402

DEFAULT_CASES = "1x512,16x512,16x512&1x64,15x512&1x112&1x448+64,64x128,1x8192,16x256+256"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}  # dense, by device_kind
CATEGORIES = ("matmul", "attention", "kv write", "kv read", "kv metadata", "norm/rope/elementwise", "head",
              "sampling", "host->device", "other")
# (file, function) of the innermost user frame -> category; a function of None matches the whole file
SOURCE_CATEGORIES = [
    ("linear.py", None, "matmul"), ("gemv_weight.py", None, "matmul"), ("laid_out.py", None, "matmul"),
    ("attention.py", "xla_attention", "attention"), ("attention.py", "cudnn_attention", "attention"),
    ("attention.py", "_cudnn_fused", "attention"), ("attention.py", "cudnn_packed_attention", "attention"),
    ("attention.py", "packed_segments", "attention"), ("attention.py", "packing_is_canonical", "attention"),
    ("attention.py", "cudnn_branch", "attention"),
    ("meta.py", None, "attention"), ("paged.py", "reduce_decode_attention", "attention"),
    ("paged.py", "write", "kv write"), ("paged.py", "read", "kv read"), ("paged.py", "gather", "kv read"),
    ("paged.py", "step", "kv metadata"),
    ("decoder.py", "logits", "head"), ("sampling.py", None, "sampling"), ("prompt_logprobs.py", None, "head"),
]
NAME_CATEGORIES = [  # kernels no source line names (custom calls, copies): by kernel name
    ("host->device", ("memcpyhtod", "htod", "h2d")),
    ("kv write", ("scatter",)),
    ("attention", ("cudnn", "fmha", "flash", "paged_decode")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "wgmma", "cublas", "sm90_")),
]


# ---- cases ------------------------------------------------------------------------------------------------------

def parse_case(text: str) -> list[tuple[int, int, int]]:
    """'16x512&1x64+448' -> [(prompts, new tokens, context before), ...]."""
    groups = []
    for part in text.split("&"):
        body, _, ctx = part.partition("+")
        p, _, n = body.partition("x")
        try:
            groups.append((int(p), int(n), int(ctx or 0)))
        except ValueError:
            raise SystemExit(f"--cases: {part!r} is not PxL or PxL+C (P prompts of L new tokens after C)") from None
        if groups[-1][0] < 1 or groups[-1][1] < 2:
            raise SystemExit(f"--cases: {part!r}: need P >= 1 prompts of L >= 2 tokens (L = 1 is a decode)")
    return groups


def case_rows(groups) -> list[tuple[int, int]]:
    """[(context before, new tokens)] per prompt of a case."""
    return [(c, n) for p, n, c in groups for _ in range(p)]


def blocks_needed(rows, bs: int) -> int:
    return sum(-(-(c + n) // bs) for c, n in rows)


class CapturingRunner(PagedRunner):
    """The serving runner, remembering each jitted call it makes (fn, batch, settings) to time it alone;
    ``fresh_calls`` False: a fresh prefill (`StepSettings.fresh`) reads its context back from the pool instead,
    as before that path existed (the A/B of --fresh)."""

    def __init__(self, *args, fresh_calls: bool = True, **kw):
        super().__init__(*args, **kw)
        self.captured: list = []
        self.fresh_calls = fresh_calls

    def _device_call(self, fn, batch, settings):
        if settings.fresh and not self.fresh_calls:
            settings = self.settings.for_call(settings.mode, settings.num_steps)  # cached, as the runner's own
        self.captured.append((fn, batch, settings))
        return super()._device_call(fn, batch, settings)


def scheduled(rows, prompts, tables, logprobs: bool, chunk: str) -> list[ScheduledRequest]:
    """The scheduler's view of one step: each row's `chunk` ("context": its first C tokens; "new": the L after)."""
    sp = SamplingParams(max_tokens=1, logprobs=logprobs, top_logprobs=MAX_TOP_LOGPROBS if logprobs else 0)
    out = []
    for i, ((c, n), toks, table) in enumerate(zip(rows, prompts, tables)):
        start, num = (0, c) if chunk == "context" else (c, n)
        if num == 0:
            continue
        req = Request(f"p{i}", list(toks), max_tokens=1, sampling_params=sp)
        out.append(ScheduledRequest(f"p{i}", num, start, list(toks[start:start + num]), table,
                                    sample=chunk == "new", sampling_params=sp, request=req))
    return out


# ---- FLOPs -----------------------------------------------------------------------------------------------------

def layer_params(cfg) -> int:
    """Weights a token multiplies per layer (q|k|v, o, gate|up, down)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return D * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * D + 3 * D * F


def case_flops(cfg, rows) -> float:
    """The real tokens' FLOPs: 2 x weights x tokens + causal attention (4 x N x H per query-key pair) + the head
    on each prompt's last token."""
    tokens = sum(n for _, n in rows)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in rows)
    L = cfg.num_layers
    return (2.0 * layer_params(cfg) * L * tokens + 4.0 * cfg.num_heads * cfg.head_dim * L * pairs
            + 2.0 * cfg.hidden_size * cfg.vocab_size * len(rows))


def peak_tflops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)


# ---- the check ---------------------------------------------------------------------------------------------------

_REFERENCE: dict[tuple[int, ...], np.ndarray] = {}  # prompt tokens -> the plain forward's last log_softmax


def reference_logprobs(model, toks) -> np.ndarray:
    """log_softmax of `Decoder.__call__`'s last logits on `toks` (`model`: the plain xla-attention build, the same
    weights as the served build's, nnx.Rngs(0), not laid out); computed once per prompt for every variant."""
    key = tuple(toks)
    if key not in _REFERENCE:
        logits = model(jnp.asarray(np.asarray(toks)[None], jnp.int32))[0, -1]
        _REFERENCE[key] = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))
    return _REFERENCE[key]


def check_case(model, rows, prompts, host: dict, tol: float, label: str, limit: int) -> dict:
    """Each prompt's first sampled token (top-20 logprobs of the serving call, `host`) against log_softmax of a
    plain forward's last logits (`Decoder.__call__` on context + new tokens, xla attention), for `limit` prompts
    of the case: the first ones and the last (a case's groups: new prompts first, a continuing chunk last)."""
    worst, agree, n = 0.0, 0, 0
    picked = sorted(set(range(min(limit - 1, len(rows)))) | {len(rows) - 1})
    for r in picked:
        (c, L), toks = rows[r], prompts[r]
        ref = reference_logprobs(model, toks[:c + L])
        ids, got = np.asarray(host["top_ids"][r]), np.asarray(host["top_logprobs"][r], np.float64)
        worst = max(worst, float(np.max(np.abs(ref[ids] - got))))  # the values at the ids the call ranked top
        top_ref = np.sort(ref)[::-1][:len(got)]
        worst = max(worst, float(np.max(np.abs(np.sort(got)[::-1] - top_ref))))  # and the top values themselves
        margin = top_ref[0] - top_ref[1]
        agree += int(ids[0] == int(np.argmax(ref)) or margin <= 2 * tol)
        n += 1
    res = {"check": label, "prompts": n, "max_abs_logprob_diff": worst, "tol": tol,
           "argmax_agrees": f"{agree}/{n}", "pass": worst <= tol and agree == n}
    print("CHECK " + json.dumps(res), flush=True)
    return res


# ---- the profile -------------------------------------------------------------------------------------------------

def source_category(src: str) -> str | None:
    """'attention.py:74 xla_attention' -> its category (SOURCE_CATEGORIES), else None."""
    where, _, func = src.partition(" ")
    file = where.split(":", 1)[0]
    for f, fn, cat in SOURCE_CATEGORIES:
        if file == f and (fn is None or fn in func.split(".")):
            return cat
    if file in ("norm.py", "rope.py", "mlp.py", "attention.py", "decoder.py", "layer_runner.py", "linear.py"):
        return "norm/rope/elementwise"
    return None


def kernel_category(event: dict, sources) -> str:
    name = event.get("name", "")
    by_name = name_category(name, NAME_CATEGORIES)
    if by_name == "host->device":
        return by_name
    src = kernel_source(event, sources) if sources else None
    cat = source_category(src[0]) if src else None
    if cat is None or (by_name == "attention" and cat != "attention"):  # a cuDNN custom call is attention
        cat = by_name if by_name != "other" else "other"
    return cat


def device_events(path: str) -> list[dict]:
    """The GPU's kernel and copy events of a trace file (`trace_summary.gpu_kernels`); on a CPU (the smoke run) the
    XLA ops of the host's compute threads (loops and calls left out: they contain the others)."""
    kernels, events, gpu_pids = gpu_kernels(path)
    if gpu_pids:
        return kernels
    return [e for e in events if e.get("ph") == "X" and "dur" in e and isinstance(e.get("args"), dict)
            and "hlo_op" in e["args"] and not e["name"].startswith(("while", "conditional", "call"))]


def profile_case(label: str, fn, calls: int, out_dir: Path, programs: list[dict]) -> dict:
    """Trace `calls` calls of fn; -> per-call ms by category, kernels per call, wall vs kernel-union ms. programs:
    the instruction_sources of the compiled programs fn may run (`dumped_sources`)."""
    trace_dir = Path(tempfile.mkdtemp(prefix="surojax-prefill-trace-"))
    jax.block_until_ready(fn())
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        wall = time.perf_counter() - t0
    path = trace_file(trace_dir)
    if path is None:
        print(f"# profile {label}: no trace written under {trace_dir}", flush=True)
        return {}
    kernels = device_events(path)
    run_sources = sources_by_run(kernels, programs)
    by_cat, other, srcs = collections.Counter(), collections.Counter(), collections.Counter()
    attributed = 0.0
    for e in kernels:
        d = float(e["dur"]) / calls
        sources = run_sources.get((e.get("args") or {}).get("run_id"), {})
        cat = kernel_category(e, sources)
        by_cat[cat] += d
        src = kernel_source(e, sources) if sources else None
        attributed += d if src else 0.0
        srcs[f"{cat:22s} {src[0] if src else e.get('name', '?')[:60]}"] += d
        if cat == "other":
            other[e.get("name", "?")[:90]] += d
    busy = sum(e - s for s, e in union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]))
    prof = {"kernels_per_call": len(kernels) / calls, "kernel_sum_ms": sum(by_cat.values()) / 1e3,
            "kernel_union_ms": busy / calls / 1e3, "wall_ms": 1e3 * wall / calls,
            "host_gap_ms": 1e3 * wall / calls - busy / calls / 1e3, "attributed_ms": attributed / 1e3,
            **{f"{c}_ms": by_cat.get(c, 0.0) / 1e3 for c in CATEGORIES}}
    print(f"# profile {label}: {prof['kernels_per_call']:.0f} kernels a call, kernel sum {prof['kernel_sum_ms']:.2f} "
          f"ms, busy {prof['kernel_union_ms']:.2f} ms of a {prof['wall_ms']:.2f} ms call (host gaps "
          f"{prof['host_gap_ms']:.2f} ms); {prof['attributed_ms']:.2f} ms of kernels traced to a source line "
          "(the rest by kernel name)", flush=True)
    for c in CATEGORIES:
        print(f"#   {c:24s} {by_cat.get(c, 0.0) / 1e3:8.3f} ms", flush=True)
    print("#   top sources (category, source line or kernel, ms a call):")
    for s, d in srcs.most_common(14):
        print(f"#     {d / 1e3:8.3f}  {s}")
    for name, d in other.most_common(5):
        print(f"#   other: {d / 1e3:8.3f}  {name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if os.path.getsize(path) < 12 * 2**20:
        shutil.copy(path, out_dir / f"prefill-{label}.trace.json.gz")
    shutil.rmtree(trace_dir, ignore_errors=True)
    return prof


_DUMPS: dict[str, dict[str, tuple[str, str]]] = {}  # optimized-HLO dump file -> its instruction_sources


def dumped_sources(dump_dir: str | None) -> list[dict[str, tuple[str, str]]]:
    """instruction_sources of every paged_step program compiled so far (each dump file parsed once)."""
    if dump_dir is None:
        return []
    for f in glob.glob(f"{dump_dir}/*paged_step*after_optimizations.txt"):
        if f not in _DUMPS:
            _DUMPS[f] = instruction_sources(Path(f).read_text())
    return list(_DUMPS.values())


def event_op(event: dict) -> str:
    args = event.get("args", {}) or {}
    op = args.get("hlo_op")
    return op.split(":")[0].strip().lstrip("%") if isinstance(op, str) else event.get("name", "")


def sources_by_run(kernels: list[dict], programs: list[dict]) -> dict:
    """run id (one execution of one program: the trace's ``run_id``; all events one group without it) -> the
    instruction_sources of the compiled program whose instruction names cover most of that run's kernels (a step
    of several calls runs several programs, whose instruction names overlap)."""
    runs: dict = collections.defaultdict(set)
    for e in kernels:
        runs[(e.get("args") or {}).get("run_id")].add(event_op(e))
    return {run: max(programs, key=lambda src: sum(op in src or op.replace(".", "_") in src for op in ops))
            for run, ops in runs.items()} if programs else {}


# ---- main --------------------------------------------------------------------------------------------------------

def build_model(cfg, dtype, attention: str):
    """As `surojax serve` builds it: the attention backend, then `decode_weights` (q|k|v and gate|up joined)."""
    model = Decoder(cfg, dtype=dtype, param_dtype=dtype, attention=parse_attention_backend(attention),
                    rngs=nnx.Rngs(0))
    laid = decode_weights(model, join_projections=True)
    return model, laid


def run_case(a, cfg, model, ref_model, attention, fresh, case, rng, dump_dir, peak) -> list[dict]:
    groups = parse_case(case)
    rows = case_rows(groups)
    bs = a.block_size
    need = blocks_needed(rows, bs)
    num_blocks = max(a.num_blocks, 2 * need + 64)
    kv_path = resolve_kv_path(KVPath(a.kv_path), cfg, bs, num_blocks)
    runner = CapturingRunner(model, num_blocks=num_blocks, block_size=bs, kv_path=kv_path,
                             buckets=RunnerBuckets(min_context=a.min_context, fine_prefill_rows=a.fine_prefill_rows),
                             fresh_calls=fresh)
    keys = jax.random.split(jax.random.key(7))  # a pool as after real traffic: every slot holds some k / v
    runner.k_pool = jax.random.normal(keys[0], runner.k_pool.shape, runner.k_pool.dtype)
    runner.v_pool = jax.random.normal(keys[1], runner.v_pool.shape, runner.v_pool.dtype)
    perm = rng.permutation(num_blocks)
    tables, at = [], 0
    for c, n in rows:
        k = -(-(c + n) // bs)
        tables.append([int(b) for b in perm[at:at + k]])
        at += k
    prompts = [rng.integers(10, cfg.vocab_size - 10, c + n).tolist() for c, n in rows]
    if any(c for c, _ in rows):  # the context chunks first (untimed): their KV is what the new tokens read
        runner.execute(scheduled(rows, prompts, tables, False, "context"))
    results = []
    label = f"{attention}-{'fresh' if fresh else 'gather'}-{case}"
    if a.check:
        out = runner.execute(scheduled(rows, prompts, tables, True, "new"))
        host = {"top_ids": np.array([[t for t, _ in out.logprobs[f"p{i}"][1]] for i in range(len(rows))]),
                "top_logprobs": np.array([[v for _, v in out.logprobs[f"p{i}"][1]] for i in range(len(rows))])}
        results.append(dict(check_case(ref_model, rows, prompts, host, a.tol, label, a.check_prompts), case=case,
                            attention=attention, fresh=bool(runner.captured[-1][2].fresh)))
    group = scheduled(rows, prompts, tables, False, "new")
    runner.captured.clear()
    t0 = time.perf_counter()
    jax.block_until_ready(runner.execute(group) and runner.k_pool)
    compile_s = time.perf_counter() - t0
    calls = list(runner.captured)  # the step's device calls (new prompts / continuing chunks apart, waves)
    shapes = []
    for _, batch, settings in calls:
        R, T = np.shape(batch.tokens)
        S = np.shape(batch.block_table)[1] * bs if batch.block_table is not None else np.shape(batch.ctx_slots)[1]
        shapes.append((int(R), int(T), int(S), bool(settings.fresh)))

    def call():
        for fn, batch, settings in calls:
            runner._device_call(fn, batch, settings)
        return runner.k_pool

    def execute():
        runner.execute(group)  # reads the sampled ids back: the host sync of an engine step
        return runner.k_pool

    def best(f):
        jax.block_until_ready(f())
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            jax.block_until_ready(f())
            times.append(time.perf_counter() - t)
        return min(times), float(np.median(times))

    call_s, call_med = best(call)
    exec_s, exec_med = best(execute)
    tokens = sum(n for _, n in rows)
    flops = case_flops(cfg, rows)
    r = {"case": case, "attention": attention, "fresh": fresh, "kv_path": kv_path.value,
         "prompts": len(rows), "tokens": tokens, "calls": [dict(zip(("R", "T", "S", "fresh"), c)) for c in shapes],
         "padding": 1 - tokens / sum(R * T for R, T, _, _ in shapes), "call_ms": 1e3 * call_s,
         "call_ms_median": 1e3 * call_med, "execute_ms": 1e3 * exec_s, "execute_ms_median": 1e3 * exec_med,
         "host_ms": 1e3 * (exec_s - call_s), "tokens_per_s": tokens / call_s, "tflops": flops / 1e12,
         "mfu": flops / call_s / (peak * 1e12) if peak else None, "compile_s": compile_s}
    if a.profile:
        r.update(profile_case(label.replace("&", "+"), call, a.profile_calls, Path(a.profile),
                              dumped_sources(dump_dir)))
    print("RESULT " + json.dumps(r), flush=True)
    return results + [r]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of PxL[+C][&PxL[+C]...] (module docstring)")
    p.add_argument("--attention", default="auto",
                   help="comma list of backends (auto: the server's default, cuDNN on a GPU; xla, cudnn)")
    p.add_argument("--fresh", default="on,off", help="comma list: on = the runner's fresh prefill (new prompts "
                   "attend over their own tokens), off = every prefill reads its context back from the pool")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--kv-path", default="auto", choices=[k.value for k in KVPath if k is not KVPath.REFERENCE])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0, help="pool blocks (default: twice what the case needs)")
    p.add_argument("--min-context", type=int, default=0,
                   help="RunnerBuckets.min_context (0: the server's; serve_load uses prompt + max_tokens + K = 648)")
    p.add_argument("--fine-prefill-rows", action="store_true",
                   help="RunnerBuckets.fine_prefill_rows: prefill rows rounded to 2^k or 1.5 x 2^k (17 -> 24, not 32)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--check-prompts", type=int, default=2, help="prompts per case checked against the forward")
    p.add_argument("--tol", type=float, default=None, help="max |logprob diff| (default: bf16 0.1, fp32 1e-3)")
    p.add_argument("--profile", default=None, metavar="DIR", help="trace, kernels by category, traces into DIR")
    p.add_argument("--profile-calls", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=0, help="skip the cases left after this many seconds (0: none)")
    p.add_argument("--smoke", action="store_true", help="CPU: debug shape, tiny cases")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.repeats = "debug", 2
        if a.cases == DEFAULT_CASES:
            a.cases = "1x24,4x16,4x16&1x5,2x8+12"
    dump_dir = None
    if a.profile:  # before the backend compiles anything: XLA reads its flags once
        dump_dir = tempfile.mkdtemp(prefix="surojax-prefill-hlo-")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*paged_step.*").strip()
    dtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32}.get(
        a.dtype, jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    if a.tol is None:
        a.tol = 0.1 if dtype == jnp.bfloat16 else 1e-3
    cfg = model_config(a.shape)
    peak = peak_tflops() if dtype == jnp.bfloat16 else None
    print(f"# prefill step: {a.shape} {jnp.dtype(dtype).name} on {jax.devices()[0].device_kind} (peak "
          f"{peak or '?'} TFLOP/s), cases {a.cases}, attention {a.attention}, min_context {a.min_context}, "
          f"fine_prefill_rows {a.fine_prefill_rows}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    results = []
    t_start = time.perf_counter()
    # the check's plain forward: xla attention, the weights as built (no decode layouts, q / k / v apart)
    ref_model = Decoder(cfg, dtype=dtype, param_dtype=dtype, attention="xla", rngs=nnx.Rngs(0)) if a.check else None
    models = {}
    for attention in a.attention.split(","):  # every backend built first: the cases are the outer loop
        models[attention], laid = build_model(cfg, dtype, attention)
        print(f"# attention {attention}: decode kernel layouts {laid or 'none'}", flush=True)
    for case in a.cases.split(","):  # in the order given: --budget-s drops the last cases, all their variants
        for attention, model in models.items():
            for fresh in (f.strip() == "on" for f in a.fresh.split(",")):
                if a.budget_s and time.perf_counter() - t_start > a.budget_s:
                    print(f"SKIPPED {attention} fresh={fresh} {case}: past --budget-s {a.budget_s:g}", flush=True)
                    continue
                try:
                    results += run_case(a, cfg, model, ref_model, attention, fresh, case, np.random.default_rng(0),
                                        dump_dir, peak)
                except Exception as e:  # noqa: BLE001 - report, keep the other cases
                    print(f"FAILED {attention} fresh={fresh} {case}: {type(e).__name__}: {str(e)[:600]}", flush=True)
    checks = [r for r in results if "check" in r]
    print("\nchecks (first sampled token's top-20 logprobs vs Decoder.__call__):")
    for r in checks:
        print(f"  {r['check']:30s} {'PASS' if r['pass'] else 'FAIL'}  max |diff| {r['max_abs_logprob_diff']:.2e} "
              f"(tol {r['tol']:g}), argmax {r['argmax_agrees']}")
    rows = [r for r in results if "check" not in r]
    cats = [c for c in CATEGORIES if any(r.get(f"{c}_ms") for r in rows)]
    print("\n| attention | fresh | case | calls: R x T (S) | padding | call ms | execute ms | tokens/s | TFLOP | MFU | "
          + " | ".join(cats) + (" | kernels | host gap ms |" if cats else ""))
    print("|---" * (10 + len(cats) + (2 if cats else 0)) + "|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        extra = "".join(f" {r.get(f'{c}_ms', 0.0):.2f} |" for c in cats)
        if cats:
            extra += f" {r.get('kernels_per_call', 0):.0f} | {r.get('host_gap_ms', 0):.2f} |"
        shape = " + ".join(f"{c['R']}x{c['T']} ({c['S']}{', fresh' if c['fresh'] else ''})" for c in r["calls"])
        print(f"| {r['attention']} | {'on' if r['fresh'] else 'off'} | {r['case']} | {shape} | "
              f"{100 * r['padding']:.0f}% | "
              f"{r['call_ms']:.2f} | {r['execute_ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.2f} | {mfu} |"
              + extra)
    return 0 if all(r["pass"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
