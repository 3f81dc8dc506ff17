"""Issue 38's kernel job: the gated delta rule's Pallas kernels (pallas_kernels/gated_delta) compiled on one GPU at
Qwen3.5 shapes, checked against the chunked form in fp32, and timed against the chunked jnp form (what impl "auto"
runs today) and flash-linear-attention's Triton kernels (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`).

    PYTHONPATH=$PWD python benchmarks/gated_delta_gpu.py --out $OUT/gdn.jsonl        # GPU, < 10 minutes
    PYTHONPATH=$PWD python benchmarks/gated_delta_gpu.py --shapes 0.8b-8x2048 --variants bv64-w4-s1,bv32-w4-s1
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/gated_delta_gpu.py --smoke   # CPU, interpret mode, no fla

Shapes (value heads H, Dk = Dv = 128; `H` is the value-head count the kernel sees, q / k repeated to it as the model
and transformers do): Qwen3.5-0.8B has 16 key and 16 value heads (the published config's `linear_num_key_heads` /
`linear_num_value_heads`, as in derived checkpoints' config.json, e.g. oopere/Qwen3.5-0.65B-Base-Rearchitected);
Qwen3.5-9B has 16 key and 32 value heads (transformers 5.17's Qwen3_5TextConfig defaults: linear_num_key_heads 16,
linear_num_value_heads 32, linear_key_head_dim = linear_value_head_dim = 128, hidden 4096, 32 layers: the 9B model;
the Qwen3.5-9B model card: "32 for V and 16 for QK, head dimension 128"). Rows: B x T = 8 x 2048 and 1 x 8192,
packed with --segments random-length segments per row (the state resets at each), no initial state; `short`:
2 x 512, 3 segments a row, an initial state and the final state in the loss, where the token-by-token reference runs.

Checks. The reference is the chunked form on the same (bf16-valued) operands upcast to fp32 with fp32 matmuls
(`jax.default_matmul_precision("highest")`); on `short` it is itself checked against the token-by-token reference
(tolerance 1e-4). Every timed implementation is checked at the shape it is timed on, by the same compiled program:
o and the gradients w.r.t. q, k, v, g, beta (and the initial state on `short`) of loss = sum(o * w) (+ sum(final
state * ws)), w random, as ||x - ref|| / ||ref|| against TOL = 1e-2: bf16 operands and outputs (o, dq, dk, dv are
rounded to bf16, ~1e-3 alone) and TF32 matmuls inside the kernels (Pallas' default precision lowers fp32 dots to
TF32 on a GPU); an indexing or masking defect moves values by O(1). NaN never passes. fla's rows are checked the
same way; its check does not change the exit status (our kernels' do).

Timing: benchmarks/timing.py's rule (3 warm-up calls, median of --repeats runs of --iters calls, wall clock around
a blocking call) for JAX; the same rule with torch.cuda.synchronize for fla. "fwd" is the forward alone (the Pallas
forward kernel without saving states); "fwd+bwd" is value_and_grad of the loss (for fla: forward + autograd.grad).
TFLOP/s uses the chunk algorithm's work (`chunk_flops`: per token and head 2C(3Dk + 2Dv) + 6 Dk Dv + C^2 / 3 for
the forward, three times that for forward + backward); GB/s the bytes the operands and results must cross HBM once.

Variants: KernelKnobs' launch knobs (block_v value columns per program, num_warps, num_stages), labelled
"bv64-w4-s1"; every variant on the shapes of --variant-shapes, the default knobs elsewhere. All JAX programs of a
shape compile in parallel threads first (compile seconds per program are printed), then run one at a time.

Output: one JSON line per measurement as it goes (`{"kind": "check" | "time" | "compile" | "skip" | "error", ...}`),
all of them to --out (JSON lines), and a table last: per shape and implementation the fwd and fwd+bwd ms, TFLOP/s,
the speed ratio to fla (fla's time / ours: > 1 is faster than fla), the worst check error. A program that does not
compile or run prints an error row and the rest go on. Exit status 1 if any of our checks failed or errored.
--budget-s: a shape that would start after this many seconds is skipped (and listed).

fla on the GPU machine: carry its wheels (benchmarks/README.md, "gated_delta_gpu.py"); when `fla` does not import
the fla rows are skipped with the reason.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (fla) shares the GPU with JAX
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta.api import (  # noqa: E402
    BLOCK_V, NUM_STAGES, NUM_WARPS, KernelKnobs, chunk_gated_delta_rule, pallas_forward, pallas_v2_forward,
    v2_operands)
from pallas_kernels.gated_delta.chunked import CHUNK, segment_numbers  # noqa: E402
from pallas_kernels.gated_delta import backward_v2, kernel_v2_bwd  # noqa: E402
from pallas_kernels.gated_delta.kernel_v2 import V2Knobs, output, states, wy  # noqa: E402
from timing import timeit  # noqa: E402  (benchmarks/ is sys.path[0])

TOL = 1e-2  # ||x - ref|| / ||ref||, bf16 operands (module docstring)
TOL_FP32 = 1e-4  # the fp32 chunked form against the token-by-token reference
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
IMPLS = ("chunked", "pallas", "pallas_v2", "reference", "fla")  # what --impls picks from


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    T: int
    H: int  # value heads (what the kernel sees)
    HK: int  # key heads (q / k repeated to H)
    Dk: int = 128
    Dv: int = 128
    segments: int = 4  # per row
    with_state: bool = False  # initial state in, final state in the loss (and fla skipped)
    reference: bool = False  # the token-by-token reference runs here


SHAPES = {s.name: s for s in (
    Shape("short", 2, 512, 16, 16, segments=3, with_state=True, reference=True),
    Shape("0.8b-8x2048", 8, 2048, 16, 16),
    Shape("0.8b-1x8192", 1, 8192, 16, 16),
    Shape("9b-8x2048", 8, 2048, 32, 16),
    Shape("9b-1x8192", 1, 8192, 32, 16),
    Shape("0.8b-8x2048-1seg", 8, 2048, 16, 16, segments=1),
)}
SMOKE_SHAPES = (Shape("smoke", 2, 130, 2, 1, Dk=16, Dv=32, segments=3, with_state=True, reference=True),)
DEFAULT_SHAPES = "short,0.8b-8x2048,0.8b-1x8192,9b-8x2048,9b-1x8192,0.8b-8x2048-1seg"


def knobs_label(block_v: int, num_warps: int, num_stages: int) -> str:
    return f"bv{block_v}-w{num_warps}-s{num_stages}"


def parse_variant(label: str) -> tuple[int, int, int]:
    """"bv64-w4-s1" -> (64, 4, 1)."""
    try:
        bv, w, s = label.split("-")
        assert bv[:2] == "bv" and w[0] == "w" and s[0] == "s"
        return int(bv[2:]), int(w[1:]), int(s[1:])
    except (ValueError, AssertionError):
        raise SystemExit(f"gated_delta_gpu: variant {label!r} is not of the form bv<block_v>-w<warps>-s<stages>")


DEFAULT_VARIANT = knobs_label(BLOCK_V, NUM_WARPS, NUM_STAGES)
# around the defaults. benchmarks/triton_offline_check.py (Triton 3.6 for sm_90, Dk = Dv = 128): every kernel uses
# 255 registers and spills (forward 1.4-2.8 KB, backward 3.9-8.2 KB a thread); the backward needs 278 / 295 / 442 KB
# of shared memory at bv64-w4 / bv64-w8 / bv128-w8 (> 227 KB: expect a compile error there), 229 KB at bv32 and
# 213 KB at bv16; num_stages 2 changed nothing (kept out). More programs (bv32, bv16: 1 x 8192 has only H x Dv / 64
# of them at the default), fewer spills (w8), one program per head (bv128: the forward only)
VARIANTS = (DEFAULT_VARIANT, "bv32-w4-s1", "bv16-w4-s1", "bv32-w8-s1", "bv16-w8-s1", "bv64-w8-s1", "bv128-w8-s1")
SMOKE_VARIANTS = (DEFAULT_VARIANT, "bv16-w4-s1")
# "pallas_v2" (kernel_v2.py, its backward the chunked form's VJP): V2Knobs' block_v (the state kernel), block_o (the
# output kernel), num_warps, num_stages. triton_offline_check.py dump-gdn (sm_90, Dk = Dv = 128): every one of these
# compiles without spills, under 150 KB of shared memory (bv128: 255 registers and spills, kept out)
V2_DEFAULT = "bv64-bo128-w4-s2"
V2_VARIANTS = (V2_DEFAULT, "bv32-bo64-w4-s2", "bv16-bo64-w4-s3", "bv32-bo64-w8-s2", "bv64-bo64-w8-s3")


def parse_v2_variant(label: str) -> tuple[int, int, int, int]:
    """"bv32-bo64-w4-s2" -> (32, 64, 4, 2)."""
    try:
        bv, bo, w, s = label.split("-")
        assert bv[:2] == "bv" and bo[:2] == "bo" and w[0] == "w" and s[0] == "s"
        return int(bv[2:]), int(bo[2:]), int(w[1:]), int(s[1:])
    except (ValueError, AssertionError):
        raise SystemExit(f"gated_delta_gpu: v2 variant {label!r} is not of the form bv<block_v>-bo<block_o>-w<warps>-s"
                         "<stages>")


def v2_knobs(label: str, scale: float, interpret: bool) -> V2Knobs:
    bv, bo, w, st = parse_v2_variant(label)
    return V2Knobs(scale=scale, interpret=interpret, block_v=bv, block_o=bo, num_warps=w, num_stages=st)


def chunk_flops(s: Shape) -> float:
    """The chunk algorithm's forward work (chunked.py's terms, C = CHUNK): per token and head K K^T, Q K^T, U = T beta
    V, W = T beta K (2 C (3 Dk + 2 Dv)), W S, Q S, K^T u (6 Dk Dv), and the unit-triangular inverse (C^2 / 3)."""
    C = CHUNK
    return s.B * s.T * s.H * (2 * C * (3 * s.Dk + 2 * s.Dv) + 6 * s.Dk * s.Dv + C * C / 3)


def min_bytes(s: Shape, backward: bool) -> float:
    """Bytes the operands and results cross HBM at least once: q, k, v, o in bf16, g fp32, beta bf16; with the
    backward also do, dq, dk, dv (bf16), dg (fp32), dbeta (bf16), and the operands read again."""
    per = (2 * s.Dk + s.Dv) * 2 + 4 + 2
    fwd = s.B * s.T * s.H * (per + 2 * s.Dv)
    return fwd + (s.B * s.T * s.H * (per + 2 * s.Dv + per) if backward else 0)


def segment_ids(s: Shape, rng: np.random.Generator) -> np.ndarray:
    """[B, T] int32: `segments` runs of random length per row, ids 1, 2, ... (no padding)."""
    rows = []
    for _ in range(s.B):
        cuts = np.sort(rng.choice(np.arange(1, s.T), s.segments - 1, replace=False)) if s.segments > 1 else []
        starts = np.concatenate([[0], cuts, [s.T]]).astype(int)
        rows.append(np.concatenate([np.full(e - b, i + 1) for i, (b, e) in enumerate(zip(starts, starts[1:]))]))
    return np.stack(rows).astype(np.int32)


def operands(s: Shape, seed: int = 0) -> dict:
    """Random operands on the device (one program): q, k unit vectors (bf16, key heads repeated to H), v bf16, g
    fp32 log decay (per head a slow ~0.006 / token or a fast ~0.3 / token decay), beta bf16 in (0, 1), the loss
    weights w (and ws, the initial state, where with_state); seg [B, T] numpy."""
    x = _random_operands(s, seed)
    x["seg"] = segment_ids(s, np.random.default_rng(seed))
    return x


@functools.partial(jax.jit, static_argnums=(0, 1))
def _random_operands(s: Shape, seed: int) -> dict:
    ks = jax.random.split(jax.random.key(seed), 8)

    def unit(key):
        x = jax.random.normal(key, (s.B, s.T, s.HK, s.Dk))
        x = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        return jnp.repeat(x, s.H // s.HK, axis=2).astype(jnp.bfloat16)

    offsets = jnp.asarray([-5.0, -1.0] * s.H)[:s.H]
    x = dict(q=unit(ks[0]), k=unit(ks[1]),
             v=jax.random.normal(ks[2], (s.B, s.T, s.H, s.Dv)).astype(jnp.bfloat16),
             g=-jax.nn.softplus(jax.random.normal(ks[3], (s.B, s.T, s.H)) + offsets),
             beta=jax.nn.sigmoid(jax.random.normal(ks[4], (s.B, s.T, s.H))).astype(jnp.bfloat16),
             w=jax.random.normal(ks[5], (s.B, s.T, s.H, s.Dv)))
    if s.with_state:
        x["initial_state"] = 0.5 * jax.random.normal(ks[6], (s.B, s.H, s.Dk, s.Dv))
        x["ws"] = jax.random.normal(ks[7], (s.B, s.H, s.Dk, s.Dv))
    return x


def leaves(x: dict) -> list:
    return [x[n] for n in GRAD_NAMES if n in x]


def make_fns(rule, s: Shape, seg) -> tuple:
    """(forward(*args) -> o, fwd_bwd(*args) -> ((loss, o), grads w.r.t. the leaves)) of args = leaves, w (, ws),
    for rule(q, k, v, g, beta, seg, initial_state, output_final_state) -> (o, final state)."""
    seg = jnp.asarray(seg)
    n = 6 if s.with_state else 5

    def forward(*args):  # the loss weights after the leaves are not used
        q, k, v, g, beta, s0 = (list(args[:n]) + [None])[:6]
        return rule(q, k, v, g, beta, seg, s0, False)[0]

    def loss(q, k, v, g, beta, s0=None, *, w, ws=None):
        o, final = rule(q, k, v, g, beta, seg, s0, ws is not None)
        return jnp.sum(o.astype(jnp.float32) * w) + (0.0 if ws is None else jnp.sum(final * ws)), o

    def fwd_bwd(*args):
        *xs, w = args[:n + 1]
        ws = args[n + 1] if s.with_state else None
        return jax.value_and_grad(functools.partial(loss, w=w, ws=ws), argnums=tuple(range(n)), has_aux=True)(*xs)

    return forward, fwd_bwd


def api_rule(impl: str, scale: float):
    def rule(q, k, v, g, beta, seg, s0, final):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, segment_ids=seg, initial_state=s0,
                                      output_final_state=final, impl=impl)
    return rule


def pallas_rule(knobs: KernelKnobs):
    def rule(q, k, v, g, beta, seg, s0, final):
        if s0 is None:
            s0 = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
        return pallas_forward(q, k, v, g, beta, seg, s0, scale=knobs.scale, interpret=knobs.interpret,
                              block_v=knobs.block_v, num_warps=knobs.num_warps, num_stages=knobs.num_stages)
    return rule


def pallas_v2_rule(knobs: V2Knobs):
    def rule(q, k, v, g, beta, seg, s0, final):
        if s0 is None:
            s0 = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
        return pallas_v2_forward(knobs, q, k, v, g, beta, segment_numbers(seg, seg.shape), s0)
    return rule


def time_v2_parts(job: "Job", s: Shape, x: dict, label: str, knobs: V2Knobs, args) -> None:
    """pallas_v2's three forward and four backward kernels timed one at a time on the shape's prepared operands
    (kind "part": ms each; the preparation, padding and cumulative decay, which XLA runs before them; the four
    backward kernels together, bwd_kernels, and backward_v2.py's jnp they replace, bwd_jnp)."""
    B, T = s.B, s.T
    s0 = x.get("initial_state", jnp.zeros((B, s.H, s.Dk, s.Dv), jnp.float32))
    numbers = segment_numbers(jnp.asarray(x["seg"]), (B, T))
    prepare = jax.jit(v2_operands)
    raw = (x["q"], x["k"], x["v"], x["g"], x["beta"], numbers, s0)
    q, k, v, gamma, beta, seg, first, last, state = prepare(*raw)
    kw = dict(knobs=knobs, chunk=CHUNK)
    fns = {"prepare": (prepare, raw),
           "wy": (jax.jit(functools.partial(wy, dtype=v.dtype, **kw)), (k, v, gamma, beta, seg, first))}
    w, u = fns["wy"][0](*fns["wy"][1])
    fns["state"] = (jax.jit(functools.partial(states, **kw)), (w, u, k, gamma, first, last, state))
    h, v_new, _ = fns["state"][0](*fns["state"][1])
    fns["output"] = (jax.jit(functools.partial(output, dtype=v.dtype, **kw)), (q, k, gamma, seg, first, h, v_new))
    # the backward's four kernels (kernel_v2_bwd.py, default BwdKnobs; its docstring's expectations) on random
    # cotangents, and backward_v2.py's jnp whole (what they replace)
    ks = jax.random.split(jax.random.key(99), 2)
    do = jax.random.normal(ks[0], v_new.shape, v.dtype)
    ds = jax.random.normal(ks[1], state.shape, jnp.float32)
    bwd = kernel_v2_bwd.BwdKnobs()
    kwb = dict(knobs=knobs, bwd=bwd, chunk=CHUNK)
    fns["bwd_wy_t"] = (jax.jit(functools.partial(kernel_v2_bwd.wy_t, dtype=v_new.dtype, **kwb)),
                       (k, gamma, beta, seg, first))
    w_b, t_b = fns["bwd_wy_t"][0](*fns["bwd_wy_t"][1])
    fns["bwd_state"] = (jax.jit(functools.partial(kernel_v2_bwd.dstates, **kwb)),
                        (q, k, w_b, do, gamma, seg, first, last, ds))
    dh, dv_new, _ = fns["bwd_state"][0](*fns["bwd_state"][1])
    fns["bwd_dqkw"] = (jax.jit(functools.partial(kernel_v2_bwd.dqkw, **kwb)),
                       (q, k, v_new, do, dv_new, h, dh, gamma, seg, first, last))
    _, dk_part, dw, dgam = fns["bwd_dqkw"][0](*fns["bwd_dqkw"][1])
    fns["bwd_wy_bwd"] = (jax.jit(functools.partial(kernel_v2_bwd.wy_bwd, **kwb)),
                         (t_b, k, v, dv_new, dw, dk_part, dgam, gamma, beta, seg, first))
    saved = (q, k, v, gamma, beta, seg, first, last, h, v_new, do, ds)
    fns["bwd_kernels"] = (jax.jit(functools.partial(kernel_v2_bwd.chunk_backward, **kw)), saved)
    fns["bwd_jnp"] = (jax.jit(functools.partial(backward_v2.chunk_backward, scale=knobs.scale, chunk=CHUNK)), saved)
    for part, (fn, fn_args) in fns.items():
        ms = timeit(fn, *fn_args, iters=args.iters, repeats=args.repeats) * 1e3
        job.emit(kind="part", shape=s.name, impl=f"pallas_v2:{label}", part=part, ms=ms)


def upcast(x: dict) -> dict:
    return {n: (a.astype(jnp.float32) if isinstance(a, jax.Array) else a) for n, a in x.items()}


@jax.jit
def _rel_err(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.linalg.norm(got - want) / jnp.linalg.norm(want)


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in fp32 on the device (one compiled program per operand signature)."""
    return float(_rel_err(jnp.asarray(got), jnp.asarray(want)))


class Job:
    """Rows printed as they come, kept for --out and the table."""

    def __init__(self, out: str | None):
        self.rows: list[dict] = []
        self.failed = 0
        self.out = open(out, "w") if out else None

    def emit(self, **row) -> dict:
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()
        return row

    def check(self, shape: str, impl: str, what: str, got, want, tol: float, counts: bool = True) -> bool:
        err = rel_err(got, want)
        ok = bool(err <= tol)  # NaN fails
        self.failed += counts and not ok
        self.emit(kind="check", shape=shape, impl=impl, what=what, rel_err=err, tol=tol, ok=ok)
        return ok


def compile_all(job: Job, programs: dict, workers: int) -> dict:
    """{key: (fn, args, context)} -> {key: compiled or None}: lowered and compiled in threads, seconds printed."""
    def build(key):
        fn, args, context = programs[key]
        t0 = time.perf_counter()
        with context():
            compiled = jax.jit(fn).lower(*args).compile()
        return compiled, time.perf_counter() - t0

    done = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(build, key) for key in programs}
        for key, fut in futures.items():
            try:
                done[key], seconds = fut.result()
                job.emit(kind="compile", shape=key[0], impl=key[1], program=key[2], seconds=round(seconds, 2))
            except Exception as e:  # noqa: BLE001 - report every failure, go on
                done[key] = None
                job.failed += key[1] != "fla"
                job.emit(kind="error", shape=key[0], impl=key[1], program=key[2], stage="compile",
                         error=f"{type(e).__name__}: {str(e).strip()[:600]}")
    return done


def time_row(job: Job, s: Shape, impl: str, program: str, seconds: float) -> None:
    backward = program == "fwd+bwd"
    flops = chunk_flops(s) * (3 if backward else 1)
    job.emit(kind="time", shape=s.name, impl=impl, program=program, ms=seconds * 1e3,
             tflops=flops / seconds / 1e12, gbps=min_bytes(s, backward) / seconds / 1e9)


def run_shape(job: Job, s: Shape, variants: list[str], args, interpret: bool, v2_variants: list[str] = ()) -> None:
    scale = s.Dk ** -0.5
    x = operands(s)
    args_of = leaves(x) + [x["w"]] + ([x["ws"]] if s.with_state else [])
    ref_args = leaves(upcast(x)) + [x["w"]] + ([x["ws"]] if s.with_state else [])
    highest = functools.partial(jax.default_matmul_precision, "highest")
    plain = contextlib.nullcontext

    impls = {"chunked": (api_rule("chunked", scale), plain)} if "chunked" in args.impls else {}
    for label in variants if "pallas" in args.impls else ():
        bv, nw, ns = parse_variant(label)
        impls[f"pallas:{label}"] = (pallas_rule(KernelKnobs(scale=scale, interpret=interpret, block_v=bv,
                                                            num_warps=nw, num_stages=ns)), plain)
    for label in v2_variants if "pallas_v2" in args.impls else ():
        impls[f"pallas_v2:{label}"] = (pallas_v2_rule(v2_knobs(label, scale, interpret)), plain)
    if s.reference and "reference" in args.impls:
        impls["reference"] = (api_rule("reference", scale), plain)

    programs = {}
    for name, (rule, context) in {"ref:chunked-fp32": (api_rule("chunked", scale), highest),
                                  **({"ref:token-fp32": (api_rule("reference", scale), highest)}
                                     if s.reference else {}), **impls}.items():
        forward, fwd_bwd = make_fns(rule, s, x["seg"])
        if name.startswith("ref:"):  # o from the fwd+bwd program
            programs[(s.name, name, "fwd+bwd")] = (fwd_bwd, ref_args, context)
        else:
            programs[(s.name, name, "fwd")] = (forward, args_of, context)
            programs[(s.name, name, "fwd+bwd")] = (fwd_bwd, args_of, context)
    compiled = compile_all(job, programs, args.workers)

    if compiled[(s.name, "ref:chunked-fp32", "fwd+bwd")] is None:
        job.emit(kind="skip", shape=s.name, why="the fp32 chunked reference did not compile: nothing to check against")
        return
    (_, ref_o), ref_grads = compiled[(s.name, "ref:chunked-fp32", "fwd+bwd")](*ref_args)
    names = [n for n in GRAD_NAMES if n in x]
    if compiled.get((s.name, "ref:token-fp32", "fwd+bwd")) is not None:  # the reference of the reference
        (_, token_o), token_grads = compiled[(s.name, "ref:token-fp32", "fwd+bwd")](*ref_args)
        job.check(s.name, "ref:chunked-fp32", "o vs token reference", ref_o, token_o, TOL_FP32)
        for n, a, b in zip(names, ref_grads, token_grads):
            job.check(s.name, "ref:chunked-fp32", f"d{n} vs token reference", a, b, TOL_FP32)

    for name in impls:
        fb, fw = compiled[(s.name, name, "fwd+bwd")], compiled[(s.name, name, "fwd")]
        try:
            if fb is not None:  # checked on the program's first call, then timed
                (_, o), grads = fb(*args_of)
                job.check(s.name, name, "o (fwd+bwd)", o, ref_o, TOL)
                for n, a, b in zip(names, grads, ref_grads):
                    job.check(s.name, name, f"d{n}", a, b, TOL)
            if fw is not None:
                job.check(s.name, name, "o", fw(*args_of), ref_o, TOL)
                time_row(job, s, name, "fwd", timeit(fw, *args_of, iters=args.iters, repeats=args.repeats))
            if fb is not None:
                time_row(job, s, name, "fwd+bwd", timeit(fb, *args_of, iters=args.iters, repeats=args.repeats))
        except Exception as e:  # noqa: BLE001
            job.failed += 1
            job.emit(kind="error", shape=s.name, impl=name, stage="run", error=f"{type(e).__name__}: {str(e)[:600]}")

    for label in v2_variants if "pallas_v2" in args.impls else ():
        try:
            time_v2_parts(job, s, x, label, v2_knobs(label, scale, interpret), args)
        except Exception as e:  # noqa: BLE001
            job.emit(kind="error", shape=s.name, impl=f"pallas_v2:{label}", stage="parts",
                     error=f"{type(e).__name__}: {str(e)[:600]}")

    if "fla" in args.impls and not s.with_state:
        run_fla(job, s, x, ref_o, ref_grads, args)


def unguard_fla() -> None:
    """fla 0.6 refuses its gated backward (chunk_bwd_dqkwg) on Hopper under Triton >= 3.4, < 3.7.1 (its issue #640:
    "produces incorrect results"; the GPU image has Triton 3.6) unless tilelang is installed (a 50 MB wheel plus
    z3-solver: more than a job can carry). Lifting the guard runs the same kernels, so their time is fla's time;
    their gradients are checked like ours (the rows say whether #640 shows at these shapes), never counted."""
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True


def run_fla(job: Job, s: Shape, x: dict, ref_o, ref_grads, args) -> None:
    """fla's chunk_gated_delta_rule on the same operands: packed rows as one row of sequences (cu_seqlens), q / k
    already normalised (use_qk_l2norm_in_kernel False, as our API's caller normalises), beta bf16, g fp32."""
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except Exception as e:  # noqa: BLE001 - any import failure skips fla
        job.emit(kind="skip", shape=s.name, impl="fla", why=f"fla does not import: {type(e).__name__}: {e}")
        return
    if args.fla_unguarded:
        unguard_fla()
    dev = torch.device("cuda")

    def to_torch(a, dtype):
        return torch.from_numpy(np.asarray(jnp.asarray(a, jnp.float32))).to(dev).to(dtype)

    B, T = s.B, s.T
    flat = (lambda t: t.reshape(1, B * T, *t.shape[2:])) if s.segments > 1 else (lambda t: t)
    q, k, v = (flat(to_torch(x[n], torch.bfloat16)).requires_grad_() for n in ("q", "k", "v"))
    g = flat(to_torch(x["g"], torch.float32)).requires_grad_()
    beta = flat(to_torch(x["beta"], torch.bfloat16)).requires_grad_()
    w = flat(to_torch(x["w"], torch.float32))
    kwargs = dict(scale=s.Dk ** -0.5, output_final_state=False, use_qk_l2norm_in_kernel=False)
    if s.segments > 1:
        seg = x["seg"]
        starts = [b * T + t for b in range(B) for t in range(T) if t == 0 or seg[b, t] != seg[b, t - 1]]
        cu = torch.tensor(starts + [B * T], dtype=torch.long)
        kwargs.update(cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu)

    def forward():
        with torch.no_grad():
            return fla_rule(q, k, v, g, beta, **kwargs)[0]

    def fwd_bwd():
        o = fla_rule(q, k, v, g, beta, **kwargs)[0]
        return torch.autograd.grad((o.float() * w).sum(), (q, k, v, g, beta))

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / args.iters)
        return statistics.median(times)

    unflat = (lambda t: t.reshape(B, T, *t.shape[2:]))
    try:  # the forward first: it runs where fla's backward refuses (below)
        t0 = time.perf_counter()
        o = forward()  # the first call autotunes fla's kernels
        torch.cuda.synchronize()
        job.emit(kind="compile", shape=s.name, impl="fla", program="first fwd (autotune)",
                 seconds=round(time.perf_counter() - t0, 2))
        job.check(s.name, "fla", "o", unflat(o).float().cpu().numpy(), ref_o, TOL, counts=False)
        time_row(job, s, "fla", "fwd", timed(forward))
        grads = fwd_bwd()
        for n, a, b in zip(GRAD_NAMES, grads, ref_grads):
            job.check(s.name, "fla", f"d{n}", unflat(a).float().cpu().numpy(), b, TOL, counts=False)
        time_row(job, s, "fla", "fwd+bwd", timed(fwd_bwd))
    except Exception as e:  # noqa: BLE001
        job.emit(kind="error", shape=s.name, impl="fla", stage="run", error=f"{type(e).__name__}: {str(e)[:600]}")


def table(rows: list[dict]) -> str:
    """Per shape and implementation: fwd / fwd+bwd ms and TFLOP/s, fla's time over ours, worst check error."""
    times = {(r["shape"], r["impl"], r["program"]): r for r in rows if r["kind"] == "time"}
    worst: dict = {}
    for r in rows:
        if r["kind"] == "check":
            key = (r["shape"], r["impl"])
            e = r["rel_err"] if r["rel_err"] == r["rel_err"] else float("inf")
            worst[key] = max(worst.get(key, 0.0), e)
    failed = {(r["shape"], r["impl"]) for r in rows if r["kind"] == "check" and not r["ok"]}
    errors = {(r["shape"], r["impl"]) for r in rows if r["kind"] == "error"}
    keys = list(dict.fromkeys([(r["shape"], r["impl"]) for r in rows if r["kind"] in ("check", "time", "error")
                               and "impl" in r]))
    head = (f"{'shape':<18} {'impl':<22} {'fwd ms':>8} {'TF/s':>6} {'x fla':>6} {'f+b ms':>8} {'TF/s':>6} "
            f"{'x fla':>6} {'max err':>8}  ok")
    lines = [head, "-" * len(head)]
    for shape, impl in keys:
        cells = []
        for program in ("fwd", "fwd+bwd"):
            r, fla = times.get((shape, impl, program)), times.get((shape, "fla", program))
            cells += ([f"{r['ms']:8.3f}", f"{r['tflops']:6.1f}",
                       f"{fla['ms'] / r['ms']:6.2f}" if fla else f"{'-':>6}"] if r else [f"{'-':>8}", f"{'-':>6}",
                                                                                       f"{'-':>6}"])
        err = worst.get((shape, impl))
        ok = "ERROR" if (shape, impl) in errors else ("FAIL" if (shape, impl) in failed else "yes")
        lines.append(f"{shape:<18} {impl:<22} {' '.join(cells)} {'-' if err is None else f'{err:8.1e}':>8}  {ok}")
    parts: dict = {}
    for r in rows:
        if r["kind"] == "part":
            parts.setdefault((r["shape"], r["impl"]), []).append(f"{r['part']} {r['ms']:.3f}")
    lines += [f"{shape:<18} {impl:<22} ms: {', '.join(cells)}" for (shape, impl), cells in parts.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any backend, interpret mode off a GPU, no fla")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"of {', '.join(SHAPES)}")
    p.add_argument("--variants", help="kernel knobs bv<block_v>-w<warps>-s<stages>, comma-separated (default: "
                   f"{','.join(VARIANTS)}; --smoke: {','.join(SMOKE_VARIANTS)})")
    p.add_argument("--v2-variants", help="pallas_v2 knobs bv<block_v>-bo<block_o>-w<warps>-s<stages> (default: "
                   f"{','.join(V2_VARIANTS)}; --smoke: {V2_DEFAULT})")
    p.add_argument("--variant-shapes", default="short,0.8b-8x2048,0.8b-1x8192",
                   help="shapes that run every variant (the others: the default knobs)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="of chunked, pallas (every variant), pallas_v2 (every v2 variant), reference (short rows "
                   "only), fla (where it imports)")
    p.add_argument("--fla-unguarded", action="store_true",
                   help="lift fla's refusal of its gated backward on Hopper + Triton < 3.7.1 (unguard_fla says why)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=8, help="compile threads")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--out", help="JSON lines of every row")
    args = p.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i and not (args.smoke and i == "fla")]
    if set(args.impls) - set(IMPLS):
        raise SystemExit(f"gated_delta_gpu: unknown impls {sorted(set(args.impls) - set(IMPLS))} (known: {IMPLS})")
    variants = [v for v in (args.variants or ",".join(SMOKE_VARIANTS if args.smoke else VARIANTS)).split(",") if v]
    for v in variants:
        parse_variant(v)
    v2_variants = [v for v in (args.v2_variants or (V2_DEFAULT if args.smoke else ",".join(V2_VARIANTS))).split(",")
                   if v]
    for v in v2_variants:
        parse_v2_variant(v)
    if args.smoke:
        shapes, variant_shapes = SMOKE_SHAPES, {"smoke"}
        args.iters, args.repeats = 1, 1
    else:
        unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
        if unknown:
            raise SystemExit(f"gated_delta_gpu: unknown shapes {unknown} (known: {', '.join(SHAPES)})")
        shapes = [SHAPES[n] for n in args.shapes.split(",")]
        variant_shapes = set(args.variant_shapes.split(","))
    interpret = jax.default_backend() != "gpu"
    job = Job(args.out)
    job.emit(kind="setup", backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
             interpret=interpret, jax=jax.__version__, chunk=CHUNK, variants=variants, tol=TOL)
    start = time.perf_counter()
    for s in shapes:
        if time.perf_counter() - start > args.budget_s:
            job.emit(kind="skip", shape=s.name, why=f"past --budget-s {args.budget_s:.0f}")
            continue
        in_sweep = s.name in variant_shapes
        run_shape(job, s, variants if in_sweep else [DEFAULT_VARIANT], args, interpret,
                  v2_variants if in_sweep else [V2_DEFAULT])
    print(table(job.rows), flush=True)
    print(f"{job.failed} of our checks / programs failed; {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if job.failed else 0


if __name__ == "__main__":
    sys.exit(main())
