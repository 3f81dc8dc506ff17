"""Fused dequantise + matmul kernels (pallas_kernels) vs XLA's dequantise-then-matmul vs a plain bf16 GEMM, on
the linears of Qwen3-8B (K x N: 4096x4096 q/o, 4096x1024 k/v, 4096x12288 gate/up, 12288x4096 down) at M = 8192
tokens, both products of a LoRA step over a frozen quantised base:

    fwd   y  [M, N] = x [M, K] @ W [K, N]
    dx    dx [M, K] = g [M, N] @ W^T

Paths: bf16 = jnp.dot on a bf16 W (the ceiling); xla = W.dequantize(bf16) then jnp.dot, one jit (what
SUROJAX_QUANT_MATMUL=xla runs); pallas = the kernel-layout conversion (QuantFormat.kernel_layout) + the
fused kernel, one jit (what SUROJAX_QUANT_MATMUL=pallas runs; the conversion is timed alone too).

Per format: the tile configurations below are tried on the 4096x4096 shape (each compiled; a failure is printed
and skipped), the fastest of each product is kept and used on all four shapes; the pallas result is checked
against the jnp reference (dequantize + jnp.dot, fp32 accumulation) on every shape: max |y - y_ref| / max |y_ref|
must stay below 1e-2 (both round to bf16; the kernel only sums in another order, and Triton may fuse a decode
multiply-add). Weights are random codes in each format's layout with sane scales, built on the device
(surojax.bench.quant_base.random_weight).

Timing: jax.block_until_ready around `iters` back-to-back calls (default 20) after a compile call and 2 warm-up
calls; median of 3 repeats. One JSON line per measurement on stdout; a table and the suggested
pallas_kernels.quant_matmul.api.AUTO_PALLAS (the formats whose fwd + dx time per decoder layer beats xla) last.

    PYTHONPATH=$PWD python benchmarks/quant_matmul_h200.py --formats q4_k,nf4,q8_0      # H200, ~3 min
    PYTHONPATH=$PWD python benchmarks/quant_matmul_h200.py --formats q5_k,q6_k,nvfp4,fp8
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/quant_matmul_h200.py --smoke   # CPU, interpret mode

--decode: the forward at decode sizes (M = 1..64 rows, one token per running sequence), where the fused kernel's
decode form (kernel.forward with K split S ways, S = kernel.splits_for) reads each weight byte once and XLA's
path dequantises into a bf16 temporary first. It measures the crossover M that pallas_kernels.quant_matmul.api
.DECODE_MAX_M holds, on whole decoder layers of Qwen3-0.6B and Qwen3-8B (q, k, v, o, gate, up, down: the
per-layer time, which is what a decode step pays).

    xla     jit(x @ w.dequantize(bf16)) on the format's own weight (for bf16: jnp.dot(x, w))
    pallas  jit(forward(x, lw, tiles, splits=S)) on lw, the KernelLayout converted ONCE beforehand
            (w.kernel_layout(128); plain_layout for bf16) and not timed: a served model converts at load
            (surojax.quant.laid_out), so only the kernel (and its fp32 partial sum) is paid per step

One timed call runs the layer of every one of `copies` independent weight sets (and inputs), so that a call
cycles through >= 96 MiB of weights (2x the H200's 50 MB L2; a real model's layers never sit in L2) and the
~10-20 us of Python dispatch per call is spread over many kernels (a 0.6B linear takes 1-5 us); the time
reported is per layer (per call / copies). Per format, the tiles are tuned on both layers at the first M:
TILE_CANDIDATES (bn, num_warps, num_stages around api.DECODE_TILES), score = sum over the two models of
t_pallas / t_xla; then S = splits_for x 0.5 and x 2 are probed with the best tiles (printed as a note only:
the api always runs splits_for). Then M ascending, all formats at each M; a model stops at the first M where
pallas is not faster (--all-rows measures on), and no new M starts after --budget seconds (marked `budget`).
Every result (both paths) is checked against reference.forward_ref on the same layout (rel err < 1e-2, FAIL
lines otherwise). Timing: timing.timeit with iters sized to ~10 ms per repeat. Output: one JSON line per
measurement, a table per format (us per layer, xla/pallas), the GB/s at the first M, and the suggested
DECODE_MAX_M / TUNED_DECODE_TILES as Python literals.

    PYTHONPATH=$PWD python benchmarks/quant_matmul_h200.py --decode --formats bf16,q4_k,q6_k,q8_0,nf4,fp8,nvfp4
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/quant_matmul_h200.py --decode --smoke   # CPU, ~15 s
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul.api import DECODE_TILES
from pallas_kernels.quant_matmul.kernel import Tiles, forward, splits_for, transposed
from pallas_kernels.quant_matmul.layout import plain_layout
from pallas_kernels.quant_matmul.reference import forward_ref, transposed_ref
from surojax.bench.quant_base import random_weight
from timing import timeit  # noqa: E402  (benchmarks/ is sys.path[0])

ALL_FORMATS = ["q4_k", "q5_k", "q6_k", "q8_0", "nf4", "nvfp4", "fp8"]
SHAPES = {"qo": (4096, 4096), "kv": (4096, 1024), "gate_up": (4096, 12288), "down": (12288, 4096)}
PER_LAYER = {"qo": 2, "kv": 2, "gate_up": 2, "down": 1}  # how often each shape occurs in one decoder layer
# Candidates whose shared memory (Triton 3.9 for sm_90, checked offline: benchmarks/triton_offline_check.py) stays
# below the H200's 227 KiB per block for every format: 2 pipeline stages for the 256-wide tiles.
FWD_TILES = [Tiles(128, 128, 128, 4, 3), Tiles(128, 128, 128, 8, 3), Tiles(128, 128, 128, 8, 3, swap=True),
             Tiles(256, 128, 128, 8, 2), Tiles(256, 128, 128, 8, 2, swap=True), Tiles(128, 256, 128, 8, 2)]
BWD_TILES = [Tiles(128, 64, 128, 4, 3), Tiles(128, 64, 128, 8, 3), Tiles(128, 128, 128, 8, 3),
             Tiles(128, 64, 128, 8, 3, swap=True), Tiles(256, 64, 128, 8, 3, swap=True)]
SMOKE_SHAPES = {"qo": (256, 256), "kv": (256, 64), "gate_up": (256, 512), "down": (512, 256)}
SMOKE_FWD = [Tiles(32, 32, 128, 4, 3), Tiles(64, 64, 128, 4, 3, swap=True)]
SMOKE_BWD = [Tiles(32, 32, 128, 4, 3), Tiles(32, 32, 128, 4, 3, swap=True)]
MAX_REL_ERR = 1e-2


T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(**rec) -> None:
    print(json.dumps({"bench": "quant_matmul", **rec}), flush=True)


@jax.jit
def _rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30)


def rel_err(a, b) -> float:
    return float(_rel_err(a, b))


def fwd_fn(tiles, interpret):
    return jax.jit(lambda x, w: forward(x, w.kernel_layout(tiles.kt), tiles=tiles, interpret=interpret))


def dx_fn(tiles, interpret):
    return jax.jit(lambda g, w: transposed(g, w.kernel_layout(tiles.kt), tiles=tiles, interpret=interpret))


XLA_FWD = jax.jit(lambda x, w: jnp.dot(x, w.dequantize(x.dtype)))
XLA_DX = jax.jit(lambda g, w: jnp.dot(g, w.dequantize(g.dtype).T))
BF16_FWD = jax.jit(lambda x, w: jnp.dot(x, w))
BF16_DX = jax.jit(lambda g, w: jnp.dot(g, w.T))
REF_FWD = jax.jit(lambda x, w, out_dtype: forward_ref(x, w.kernel_layout(128), out_dtype), static_argnums=2)
REF_DX = jax.jit(lambda g, w, out_dtype: transposed_ref(g, w.kernel_layout(128), out_dtype), static_argnums=2)


def tune(name, fn_of, candidates, a, w, interpret, iters, product):
    """Time each candidate tile config; return (best Tiles, its seconds) or (None, inf) when all failed."""
    best, best_t = None, float("inf")
    for tiles in candidates:
        try:
            t = timeit(fn_of(tiles, interpret), a, w, iters=iters)
        except Exception as e:  # a config Triton cannot compile (or runs out of shared memory): skip it
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            log(f"{name} {product} {tiles.label()}: FAILED {type(e).__name__}: {msg}")
            emit(kind="tune", format=name, product=product, tiles=tiles.label(), error=f"{type(e).__name__}: {msg}")
            continue
        emit(kind="tune", format=name, product=product, tiles=tiles.label(), ms=t * 1e3)
        log(f"{name} {product} {tiles.label()}: {t * 1e3:.3f} ms")
        if t < best_t:
            best, best_t = tiles, t
    return best, best_t


# ------------------------------------------------------------------------------------------------ decode mode

# One decoder layer's linears, K x N, in layer order; each model's layer is timed as a whole.
DECODE_MODELS = {
    "qwen3-0.6b": {"q": (1024, 2048), "k": (1024, 1024), "v": (1024, 1024), "o": (2048, 1024),
                   "gate": (1024, 3072), "up": (1024, 3072), "down": (3072, 1024)},
    "qwen3-8b": {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
                 "gate": (4096, 12288), "up": (4096, 12288), "down": (12288, 4096)},
}
SMOKE_DECODE_MODELS = {
    "tiny-a": {"q": (256, 512), "k": (256, 256), "v": (256, 256), "o": (512, 256),
               "gate": (256, 512), "up": (256, 512), "down": (512, 256)},
    "tiny-b": {"q": (256, 256), "k": (256, 256), "v": (256, 256), "o": (256, 256),
               "gate": (256, 512), "up": (256, 512), "down": (512, 256)},
}
# the activation each linear reads (q, k, v share the attention input; gate, up the MLP input), as in a layer
INPUT_OF = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "attn_out", "gate": "mlp_in", "up": "mlp_in",
            "down": "mlp_act"}
DECODE_FORMATS = ["bf16"] + ALL_FORMATS
DECODE_ROWS = "1,2,4,8,16,32,64"
L2_SPAN = 96 << 20     # weight bytes one timed call cycles through: ~2x the H200's 50 MB L2 (as a real model does)
MAX_COPIES = 64
TILE_CANDIDATES = [DECODE_TILES, *(dataclasses.replace(DECODE_TILES, **kw) for kw in (
    {"bn": 32}, {"bn": 128}, {"num_warps": 8}, {"num_stages": 3}, {"bn": 128, "num_warps": 8},
    {"bn": 32, "num_stages": 3}))]
SMOKE_TILE_CANDIDATES = [DECODE_TILES, dataclasses.replace(DECODE_TILES, bn=32)]
SPLIT_FACTORS = (0.5, 2.0)   # S = splits_for(...) x factor (where it divides K / kt), probed with the best tiles


def _random_linear(fmt: str, k: int, n: int, key, lead: tuple[int, ...]):
    if fmt == "bf16":
        return (0.02 * jax.random.normal(key, (*lead, k, n), jnp.float32)).astype(jnp.bfloat16)
    return random_weight(fmt, k, n, key, lead)


def _layout(w):
    """The KernelLayout a served model holds (converted once at load): plain_layout for a bf16 weight."""
    return plain_layout(w) if isinstance(w, jax.Array) else w.kernel_layout(128)


def _nbytes(tree) -> int:
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


@dataclasses.dataclass(eq=False)   # compared and hashed by identity (a Job is a dict key)
class LayerSet:
    """`copies` independent copies of one model's decoder-layer linears in one format: inputs at the largest M,
    the format's weights, their kernel layouts (converted here, once, outside anything timed) and the reference
    output of copy 0. The copies keep the weights out of L2 and the dispatch cost out of the time."""

    fmt: str
    model: str
    shapes: dict
    copies: int
    inputs: list          # per copy: role -> x [rows, K] bf16
    native: list          # per copy: name -> the format's weight (a bf16 array for bf16)
    layout: list          # per copy: name -> KernelLayout
    ref: dict             # name -> forward_ref of copy 0 [rows, N] fp32
    native_bytes: int     # of one copy
    layout_bytes: int
    layout_name: str      # the api's key (LayoutSpec.name; "bfloat16" for a plain weight)

    def at(self, m: int) -> list:
        return [{r: x[:m] for r, x in c.items()} for c in self.inputs]


def build_set(fmt: str, model: str, shapes: dict, rows: int, key, smoke: bool) -> LayerSet:
    def one_copy(key):
        ws = {name: _random_linear(fmt, k, n, key, ()) for name, (k, n) in shapes.items()}
        return ws, {name: _layout(w) for name, w in ws.items()}

    native_bytes, layout_bytes = map(_nbytes, jax.eval_shape(one_copy, key))
    copies = 1 if smoke else max(1, min(MAX_COPIES, math.ceil(L2_SPAN / min(native_bytes, layout_bytes))))

    def build(key):
        k_of = {INPUT_OF[name]: k for name, (k, _) in shapes.items()}          # role -> K
        xs = {role: jax.random.normal(jax.random.fold_in(key, 100 + i), (copies, rows, k), jnp.float32)
              .astype(jnp.bfloat16) for i, (role, k) in enumerate(k_of.items())}
        ws = {name: _random_linear(fmt, k, n, jax.random.fold_in(key, i), (copies,))
              for i, (name, (k, n)) in enumerate(shapes.items())}
        lws = {name: jax.vmap(_layout)(w) for name, w in ws.items()}
        part = lambda tree, c: jax.tree.map(lambda a: a[c], tree)  # noqa: E731  copy c of stacked leaves
        return [part(xs, c) for c in range(copies)], [part(ws, c) for c in range(copies)], \
            [part(lws, c) for c in range(copies)]

    inputs, native, layout = jax.jit(build)(key)
    ref = jax.jit(lambda xs, lws: {n: forward_ref(xs[INPUT_OF[n]], lw, jnp.float32) for n, lw in lws.items()})(
        inputs[0], layout[0])
    lname = next(iter(layout[0].values())).spec.name
    return LayerSet(fmt, model, shapes, copies, inputs, native, layout, ref, native_bytes, layout_bytes, lname)


def decode_splits(m: int, k: int, n: int, tiles: Tiles, factor: float = 1.0) -> int:
    """S of the decode form: splits_for's (what the api runs) times `factor` where that divides K / kt."""
    s = splits_for(m, k, n, tiles)
    t = s * factor
    n_k = k // tiles.kt
    return int(t) if t == int(t) and 1 <= t <= n_k and n_k % int(t) == 0 else s


def _xla_linear(x, w):
    """What SUROJAX_QUANT_MATMUL=xla runs: dequantise then XLA's GEMM (a plain GEMM for a bf16 weight)."""
    return jnp.dot(x, w if isinstance(w, jax.Array) else w.dequantize(x.dtype))


@dataclasses.dataclass(frozen=True)
class Job:
    """One measurement: every copy of a LayerSet's linears at M rows, by one path (pallas: with these tiles and
    K splits per linear, a tuple of (name, S))."""

    ls: LayerSet
    path: str                 # "xla" | "pallas"
    m: int
    tiles: Tiles | None = None
    splits: tuple = ()
    interpret: bool = False

    @classmethod
    def pallas(cls, ls: LayerSet, m: int, tiles: Tiles, interpret: bool, factor: float = 1.0) -> "Job":
        splits = tuple((n, decode_splits(m, k, nn, tiles, factor)) for n, (k, nn) in ls.shapes.items())
        return cls(ls, "pallas", m, tiles, splits, interpret)

    def fn(self):
        splits = dict(self.splits)

        def run(inputs, weights):
            out = []
            for x, w in zip(inputs, weights):
                for name in self.ls.shapes:
                    a = x[INPUT_OF[name]]
                    out.append(_xla_linear(a, w[name]) if self.path == "xla" else
                               forward(a, w[name], tiles=self.tiles, interpret=self.interpret, splits=splits[name]))
            return out
        return jax.jit(run)

    def args(self):
        return self.ls.at(self.m), self.ls.native if self.path == "xla" else self.ls.layout

    def label(self) -> str:
        tl = f" {self.tiles.label()} S {dict(self.splits)}" if self.path == "pallas" else ""
        return f"{self.ls.fmt} {self.ls.model} M={self.m} {self.path}{tl}"


def _error_text(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"


def compile_jobs(jobs, threads: int) -> dict:
    """Job -> compiled executable, or the exception. Pallas programs compile concurrently: they hold no GEMM, so
    XLA autotunes nothing on the device meanwhile (XLA jobs are compiled alone, when first called)."""
    def one(job):
        try:
            return job.fn().lower(*job.args()).compile()
        except Exception as e:  # a config Triton cannot compile: reported by measure
            return e
    jobs = list(dict.fromkeys(jobs))
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as ex:
        return dict(zip(jobs, ex.map(one, jobs)))


def measure(job: Job, target_s: float, done: dict, compiled=None, kind: str = "decode") -> dict | None:
    """Time one job (seconds per call / copies = per layer) and check copy 0 against the reference; memoised in
    `done`. -> the record (also emitted as a JSON line), or None when it did not compile or run."""
    if job in done:
        return done[job]
    ls = job.ls
    try:
        if isinstance(compiled, Exception):
            raise compiled
        fn = compiled or job.fn()
        args = job.args()
        out = jax.block_until_ready(fn(*args))                       # compile (xla) + first call
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        iters = max(1, min(1000, int(target_s / (time.perf_counter() - t0))))
        t = timeit(fn, *args, iters=iters) / ls.copies
    except Exception as e:  # e.g. tiles that do not compile (shared memory) for this format
        log(f"{job.label()}: FAILED {_error_text(e)}")
        emit(kind=kind, format=ls.fmt, model=ls.model, M=job.m, path=job.path,
             tiles=job.tiles.label() if job.tiles else None, splits=dict(job.splits), error=_error_text(e))
        done[job] = None
        return None
    errs = {n: rel_err(y, ls.ref[n][:job.m]) for n, y in zip(ls.shapes, out)}
    for n, e in errs.items():
        if not e < MAX_REL_ERR:
            print(f"FAIL {job.label()}: {n} {ls.shapes[n]} rel err {e:.3g} >= {MAX_REL_ERR}", flush=True)
    nbytes = ls.layout_bytes if job.path == "pallas" else ls.native_bytes
    rec = dict(kind=kind, format=ls.fmt, layout=ls.layout_name, model=ls.model, M=job.m, path=job.path,
               us=t * 1e6, copies=ls.copies, iters=iters, weight_bytes=nbytes, gbps=nbytes / t / 1e9,
               rel_err=max(errs.values()), ok=all(e < MAX_REL_ERR for e in errs.values()))
    if job.path == "pallas":
        rec.update(tiles=job.tiles.label(), splits=dict(job.splits))
    emit(**rec)
    done[job] = rec
    return rec


def tune_decode(fmt, sets, m, candidates, interpret, target_s, threads, done, factors=SPLIT_FACTORS):
    """Best tiles of a format at M = m on the whole layers: score = the sum over the models of t_pallas / t_xla.
    Then S = splits_for x factors with those tiles (reported only: the api runs splits_for).
    -> (best Tiles or None, {factor: score})."""
    xla = {mo: measure(Job(ls, "xla", m), target_s, done, kind="decode_tune") for mo, ls in sets.items()}
    if not all(xla.values()):
        return None, {}

    def scores(grid: dict) -> dict:              # key -> [one job per model] => key -> score
        compiled = compile_jobs([j for jobs in grid.values() for j in jobs], threads)
        recs = {key: [measure(j, target_s, done, compiled.get(j), kind="decode_tune") for j in jobs]
                for key, jobs in grid.items()}
        return {key: sum(r["us"] / xla[r["model"]]["us"] if r and r["ok"] else math.inf for r in rs)
                for key, rs in recs.items()}

    tile_scores = scores({t: [Job.pallas(ls, m, t, interpret) for ls in sets.values()] for t in candidates})
    for t, sc in tile_scores.items():
        log(f"{fmt} tune {t.label()}: sum over {list(sets)} of pallas/xla per layer at M={m} = {sc:.3f}")
    best = min(tile_scores, key=tile_scores.get)
    if not math.isfinite(tile_scores[best]):
        return None, {}
    probes = {f: [Job.pallas(ls, m, best, interpret, f) for ls in sets.values()] for f in factors}
    probes = {f: jobs for f, jobs in probes.items() if any(j not in done for j in jobs)}  # S changed somewhere
    return best, {1.0: tile_scores[best], **scores(probes)}


def decode_max_m(res: dict, models, rows) -> tuple[int, bool]:
    """The largest M at which pallas beats xla per layer on every model, and at every smaller M. -> (M, whether a
    larger M was left unmeasured while pallas still won there: the value is then a lower bound)."""
    best = 0
    for m in rows:
        cells = [res.get((model, m)) for model in models]
        if any(c is None for c in cells):
            return best, best > 0 and all(c is None or c["win"] for c in cells)
        if not all(c["win"] for c in cells):
            return best, False
        best = m
    return best, False


def decode_main(args, p) -> int:
    smoke = args.smoke
    interpret = smoke or jax.default_backend() != "gpu"
    models = SMOKE_DECODE_MODELS if smoke else DECODE_MODELS
    if args.models and not smoke:
        names = [x.strip() for x in args.models.split(",") if x.strip()]
        if set(names) - set(models):
            p.error(f"--models: unknown {sorted(set(names) - set(models))}; choose from {list(models)}")
        models = {k: models[k] for k in names}
    candidates = SMOKE_TILE_CANDIDATES if smoke else TILE_CANDIDATES
    rows = sorted({int(r) for r in (args.rows or ("1,4" if smoke else DECODE_ROWS)).split(",") if r.strip()})
    if not rows or rows[0] < 1 or rows[-1] > 64:
        p.error("--rows: M between 1 and 64 (the decode form)")
    formats = [f.strip().lower() for f in (args.formats or ("bf16,q4_k" if smoke else ",".join(DECODE_FORMATS)))
               .split(",") if f.strip()]
    unknown = [f for f in formats if f not in DECODE_FORMATS]
    if unknown:
        p.error(f"--formats: no kernel for {unknown}; choose from {DECODE_FORMATS}")
    target_s = 0.0 if smoke else 0.01       # ~10 ms per timed repeat: ~40 ms per measurement with the warm-ups
    threads = args.compile_threads
    log(f"decode: backend {jax.default_backend()} ({jax.devices()[0].device_kind}), interpret={interpret}, "
        f"rows={rows}, formats={formats}, models={list(models)}, budget {args.budget:.0f} s")
    if interpret and not smoke:
        log("no GPU: the kernels run in interpret mode (timings are meaningless)")

    sets = {}
    for fi, fmt in enumerate(formats):
        kf = jax.random.fold_in(jax.random.key(0), fi)
        sets[fmt] = {mo: build_set(fmt, mo, shapes, rows[-1], jax.random.fold_in(kf, mi), smoke)
                     for mi, (mo, shapes) in enumerate(models.items())}
        log(f"{fmt}: built; " + ", ".join(f"{mo} {ls.copies} copies of {ls.layout_bytes / 1e6:.1f} MB layout, "
                                          f"{ls.native_bytes / 1e6:.1f} MB native" for mo, ls in sets[fmt].items()))

    done = {}                                    # Job -> record (the tuning's measurements at rows[0] are reused)
    best, split_scores = {}, {}
    for fmt in formats:
        short = time.perf_counter() - T0 > 0.5 * args.budget     # leave the sweep time: tune nothing more
        if short:
            log(f"{fmt}: half the budget spent: DECODE_TILES only, no S probe")
        best[fmt], split_scores[fmt] = tune_decode(fmt, sets[fmt], rows[0], candidates[:1] if short else candidates,
                                                   interpret, target_s, threads, done, () if short else SPLIT_FACTORS)
        log(f"{fmt}: best tiles {best[fmt].label() if best[fmt] else None}; S factor scores {split_scores[fmt]}")
        emit(kind="decode_best", format=fmt, tiles=best[fmt].label() if best[fmt] else None,
             split_scores={str(f): s for f, s in split_scores[fmt].items()})

    # the sweep, M ascending over all formats, so that a budget cut leaves the small M (where decode lives)
    # measured; a model stops at the first M where pallas is not faster, unless --all-rows
    res = {fmt: {} for fmt in formats}          # fmt -> (model, M) -> cell
    active = [(fmt, mo) for fmt in formats for mo in models if best[fmt] is not None]
    cut = {}                                     # (fmt, model) -> the first M the budget left unmeasured
    last_step = 0.0
    for m in rows:
        if not active:
            break
        t_step = time.perf_counter()
        step_fits = m == rows[0] or time.perf_counter() - T0 + last_step <= args.budget   # the first M always
        jobs = {(fmt, mo): Job.pallas(sets[fmt][mo], m, best[fmt], interpret) for fmt, mo in active}
        compiled = compile_jobs([j for j in jobs.values() if j not in done], threads) if step_fits else {}
        measured = 0
        for fmt, mo in list(active):
            if not step_fits or (m != rows[0] and time.perf_counter() - T0 > args.budget):
                cut[fmt, mo] = m
                active.remove((fmt, mo))
                continue
            rx = measure(Job(sets[fmt][mo], "xla", m), target_s, done)
            rp = measure(jobs[fmt, mo], target_s, done, compiled.get(jobs[fmt, mo]))
            measured += 1
            win = bool(rx and rp and rp["ok"] and rp["us"] < rx["us"])
            if rx:
                res[fmt][mo, m] = {"xla": rx["us"], "pallas": rp["us"] if rp else None, "win": win,
                                   "gbps": rp["gbps"] if rp else None, "xla_gbps": rx["gbps"]}
            if not win and not (rx and args.all_rows):
                active.remove((fmt, mo))
        last_step = time.perf_counter() - t_step
        log(f"M={m}: {measured} layer pairs in {last_step:.1f} s (elapsed {time.perf_counter() - T0:.0f} s)")
    if cut:
        log(f"budget of {args.budget:.0f} s spent: not measured from M = {min(cut.values())} on "
            f"({len(cut)} format x model series cut)")

    print_decode_tables(formats, models, rows, sets, res, best, split_scores, cut)
    fails = [r for r in done.values() if r and not r["ok"]]
    print(f"\ncorrectness (pallas and xla vs the jnp reference, rel err < {MAX_REL_ERR}): "
          f"{'ok' if not fails else f'{len(fails)} FAILED'}")
    log(f"done in {time.perf_counter() - T0:.0f} s")
    return 1 if fails else 0


def print_decode_tables(formats, models, rows, sets, res, best, split_scores, cut):
    print("\nDecode: microseconds per decoder layer (its 7 linears, one call each); xla = dequantise + XLA's GEMM on "
          "the format's weight, pallas = the fused kernel's decode form on the layout converted beforehand")
    suggest_m, suggest_tiles = {}, {}
    for fmt in formats:
        lname = next(iter(sets[fmt].values())).layout_name
        print(f"\n### {fmt} (layout {lname}, tiles {best[fmt].label() if best[fmt] else 'none compiled and passed'})\n")
        print("| M | " + " | ".join(f"{mo} xla us | {mo} pallas us | xla/pallas" for mo in models) + " |")
        print("|---|" + "---|---|---|" * len(models))
        for m in rows:
            cells = []
            for mo in models:
                c = res[fmt].get((mo, m))
                if c is None:
                    why = "budget" if m >= cut.get((fmt, mo), math.inf) else "-"
                    cells.append(f"{why} | {why} | {why}")
                elif c["pallas"] is None:
                    cells.append(f"{c['xla']:.1f} | failed | -")
                else:
                    cells.append(f"{c['xla']:.1f} | {c['pallas']:.1f} | {c['xla'] / c['pallas']:.2f}")
            print(f"| {m} | " + " | ".join(cells) + " |")
        first = {mo: res[fmt][mo, rows[0]] for mo in models if (mo, rows[0]) in res[fmt]}
        if first:
            pal = ", ".join(f"{mo} {c['gbps']:.0f} GB/s ({sets[fmt][mo].layout_bytes / 1e6:.1f} MB/layer)"
                            for mo, c in first.items() if c["gbps"])
            xla = ", ".join(f"{mo} {c['xla_gbps']:.0f} GB/s ({sets[fmt][mo].native_bytes / 1e6:.1f} MB/layer)"
                            for mo, c in first.items())
            print(f"at M={rows[0]}: pallas reads its layout at {pal or '-'}; xla reads the format's weight at {xla} "
                  "(H200 HBM: ~4800 GB/s)")
        sc = split_scores[fmt]
        for f, s in sc.items():
            if f != 1.0 and s < 0.97 * sc[1.0]:
                print(f"note: S = splits_for x{f:g} scored {s:.3f} vs {sc[1.0]:.3f} (sum of pallas/xla at M={rows[0]}):"
                      f" splits_for's `programs` may want {'raising' if f > 1 else 'lowering'}")
        mm, lower_bound = decode_max_m(res[fmt], models, rows)
        if lower_bound:
            print(f"note: pallas still faster at the last M measured: DECODE_MAX_M[{lname!r}] >= {mm}")
        if mm:
            suggest_m[lname] = mm
        if best[fmt] is not None and best[fmt] != DECODE_TILES:
            suggest_tiles[lname] = best[fmt]
    print(f"\nsuggested pallas_kernels.quant_matmul.api values (DECODE_MAX_M: the largest M at which pallas beats xla "
          f"per layer on {' and '.join(models)}, and at every smaller M):")
    print(f"DECODE_MAX_M: dict[str, int] = {suggest_m!r}")
    print("TUNED_DECODE_TILES: dict[str, Tiles] = {" + "".join(f"\n    {k!r}: {v!r}," for k, v in
                                                             suggest_tiles.items()) + ("\n}" if suggest_tiles else "}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--formats", default=None, help=f"default {','.join(ALL_FORMATS)}; --decode: "
                   f"{','.join(DECODE_FORMATS)} (bf16,q4_k with --smoke)")
    p.add_argument("--shapes", default="qo,kv,gate_up,down", help="which of qo, kv, gate_up, down (qo is always "
                   "timed: the tiles are tuned on it)")
    p.add_argument("--m", type=int, default=None, help="tokens (default 8192; 64 with --smoke)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per repeat (default 20; 2 with --smoke)")
    p.add_argument("--decode", action="store_true", help="the decode-shaped forward (M <= 64) of whole Qwen3-0.6B "
                   "and Qwen3-8B layers, xla vs pallas on the pre-computed layout, and the crossover M")
    p.add_argument("--rows", default=None, help=f"--decode: the M values (default {DECODE_ROWS}; 1,4 with --smoke)")
    p.add_argument("--all-rows", action="store_true", help="--decode: measure every M (default: a model stops at "
                   "the first M where pallas is not faster)")
    p.add_argument("--budget", type=float, default=220.0, help="--decode: seconds (since start) after which no new "
                   "M is started (the first always is)")
    p.add_argument("--models", default=None, help=f"--decode: comma list of {', '.join(DECODE_MODELS)} (default all)")
    p.add_argument("--compile-threads", type=int, default=8, help="--decode: pallas programs compiled concurrently")
    args = p.parse_args(argv)
    if args.decode:
        return decode_main(args, p)

    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    wanted = {"qo"} | {x.strip() for x in args.shapes.split(",") if x.strip()}
    if wanted - set(shapes):
        p.error(f"--shapes: unknown {sorted(wanted - set(shapes))}; choose from {list(shapes)}")
    shapes = {k: v for k, v in shapes.items() if k in wanted}
    fwd_cands, bwd_cands = (SMOKE_FWD, SMOKE_BWD) if args.smoke else (FWD_TILES, BWD_TILES)
    m = args.m or (64 if args.smoke else 8192)
    iters = args.iters or (2 if args.smoke else 20)
    formats = [f.strip().lower() for f in (args.formats or ",".join(ALL_FORMATS)).split(",") if f.strip()]
    unknown = [f for f in formats if f not in ALL_FORMATS]
    if unknown:
        p.error(f"--formats: no kernel for {unknown}; choose from {ALL_FORMATS}")
    log(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), interpret={interpret}, M={m}, "
        f"iters={iters}, formats={formats}")
    if interpret and not args.smoke:
        log("no GPU: the kernels run in interpret mode (timings are meaningless)")

    key = jax.random.key(0)
    kx, kg, kw = jax.random.split(key, 3)
    acts, bf16 = {}, {}
    for sname, (k, n) in shapes.items():
        x = jax.random.normal(jax.random.fold_in(kx, k), (m, k), jnp.float32).astype(jnp.bfloat16)
        g = jax.random.normal(jax.random.fold_in(kg, n), (m, n), jnp.float32).astype(jnp.bfloat16)
        wb = (0.02 * jax.random.normal(jax.random.fold_in(kw, k * n), (k, n), jnp.float32)).astype(jnp.bfloat16)
        acts[sname] = (x, g)
        bf16[sname] = (timeit(BF16_FWD, x, wb, iters=iters), timeit(BF16_DX, g, wb, iters=iters))
        for prod, t in zip(("fwd", "dx"), bf16[sname]):
            emit(kind="time", format="bf16", shape=sname, K=k, N=n, M=m, product=prod, path="bf16", ms=t * 1e3,
                 tflops=2 * m * k * n / t / 1e12)
        log(f"bf16 {sname} {k}x{n}: fwd {bf16[sname][0] * 1e3:.3f} ms, dx {bf16[sname][1] * 1e3:.3f} ms")
        del wb

    rows, totals, best_tiles = [], {}, {}
    for fi, name in enumerate(formats):
        tune_shape = "qo"
        k, n = shapes[tune_shape]
        w = random_weight(name, k, n, jax.random.fold_in(kw, fi))
        x, g = acts[tune_shape]
        best_f, _ = tune(name, fwd_fn, fwd_cands, x, w, interpret, iters, "fwd")
        best_b, _ = tune(name, dx_fn, bwd_cands, g, w, interpret, iters, "dx")
        log(f"{name}: best fwd {best_f.label() if best_f else None}, best dx {best_b.label() if best_b else None}")
        emit(kind="best", format=name, fwd=best_f.label() if best_f else None, dx=best_b.label() if best_b else None)
        if best_f and best_b:
            best_tiles[name] = (best_f, best_b)
        tot = {"bf16": 0.0, "xla": 0.0, "pallas": 0.0}
        for sname, (k, n) in shapes.items():
            w = random_weight(name, k, n, jax.random.fold_in(kw, 100 * fi + k + n))
            x, g = acts[sname]
            res = {}
            for prod, a, xla, best, fn_of, ref in (("fwd", x, XLA_FWD, best_f, fwd_fn, REF_FWD),
                                                   ("dx", g, XLA_DX, best_b, dx_fn, REF_DX)):
                t_bf = bf16[sname][0 if prod == "fwd" else 1]
                t_xla = timeit(xla, a, w, iters=iters)
                t_pal, err = float("nan"), float("nan")
                if best is not None:
                    try:
                        fn = fn_of(best, interpret)
                        err = rel_err(fn(a, w), ref(a, w, jnp.float32))
                        t_pal = timeit(fn, a, w, iters=iters)
                    except Exception as e:  # e.g. the tuned tiles do not fit another shape
                        log(f"{name} {sname} {prod} {best.label()}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    if not err < MAX_REL_ERR:
                        log(f"{name} {sname} {prod}: WRONG RESULT rel err {err:.3g} > {MAX_REL_ERR}")
                for path, t in (("xla", t_xla), ("pallas", t_pal)):
                    emit(kind="time", format=name, shape=sname, K=k, N=n, M=m, product=prod, path=path, ms=t * 1e3,
                         tflops=2 * m * k * n / t / 1e12, vs_bf16=t_bf / t,
                         **({"tiles": best.label() if best else None, "rel_err": err} if path == "pallas" else {}))
                tot["bf16"] += PER_LAYER[sname] * t_bf
                tot["xla"] += PER_LAYER[sname] * t_xla
                tot["pallas"] += PER_LAYER[sname] * t_pal
                res[prod] = (t_bf, t_xla, t_pal, err, best.label() if best else "-")
            t_conv = timeit(jax.jit(lambda w: w.kernel_layout(128)), w, iters=iters)
            emit(kind="time", format=name, shape=sname, K=k, N=n, product="to_layout", path="pallas", ms=t_conv * 1e3)
            log(f"{name} {sname}: " + ", ".join(f"{pr} bf16 {r[0] * 1e3:.3f} xla {r[1] * 1e3:.3f} pallas "
                                                 f"{r[2] * 1e3:.3f} ms (err {r[3]:.1e})" for pr, r in res.items()))
            rows.append((name, sname, k, n, res, t_conv))
        totals[name] = tot

    print("\n| format | shape | K x N | product | bf16 ms | xla ms (bf16/xla) | pallas ms (bf16/pallas) | rel err | "
          "tiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, sname, k, n, res, t_conv in rows:
        for prod, (t_bf, t_xla, t_pal, err, tl) in res.items():
            print(f"| {name} | {sname} | {k}x{n} | {prod} | {t_bf * 1e3:.3f} | {t_xla * 1e3:.3f} ({t_bf / t_xla:.2f}x) "
                  f"| {t_pal * 1e3:.3f} ({t_bf / t_pal:.2f}x) | {err:.1e} | {tl} |")
    print("\nfwd + dx over the timed shapes, each counted as often as in one decoder layer "
          "(qo 2, kv 2, gate_up 2, down 1):")
    print("| format | bf16 ms | xla ms (bf16/xla) | pallas ms (bf16/pallas) | faster |")
    print("|---|---|---|---|---|")
    winners = []
    for name, tot in totals.items():
        faster = "pallas" if tot["pallas"] < tot["xla"] else "xla"
        if faster == "pallas":
            winners.append(name)
        print(f"| {name} | {tot['bf16'] * 1e3:.3f} | {tot['xla'] * 1e3:.3f} ({tot['bf16'] / tot['xla']:.2f}x) | "
              f"{tot['pallas'] * 1e3:.3f} ({tot['bf16'] / tot['pallas']:.2f}x) | {faster} |")
    ok = all(res[prod][3] < MAX_REL_ERR for *_, res, _ in rows for prod in res)
    print(f"\ncorrectness (pallas vs jnp reference, rel err < {MAX_REL_ERR}): {'ok' if ok else 'FAILED'}")
    print(f"suggested pallas_kernels.quant_matmul.api.AUTO_PALLAS = frozenset({sorted(winners)})")
    print("best tiles (pallas_kernels.quant_matmul.api.TUNED_TILES entries, fwd and dx):")
    for name, (f, b) in best_tiles.items():
        print(f"    {name!r}: ({f!r}, {b!r}),")
    log(f"done in {time.perf_counter() - T0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
