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
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul.kernel import Tiles, forward, transposed
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--formats", default=",".join(ALL_FORMATS))
    p.add_argument("--shapes", default="qo,kv,gate_up,down", help="which of qo, kv, gate_up, down (qo is always "
                   "timed: the tiles are tuned on it)")
    p.add_argument("--m", type=int, default=None, help="tokens (default 8192; 64 with --smoke)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per repeat (default 20; 2 with --smoke)")
    args = p.parse_args(argv)

    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    wanted = {"qo"} | {x.strip() for x in args.shapes.split(",") if x.strip()}
    if wanted - set(shapes):
        p.error(f"--shapes: unknown {sorted(wanted - set(shapes))}; choose from {list(shapes)}")
    shapes = {k: v for k, v in shapes.items() if k in wanted}
    fwd_cands, bwd_cands = (SMOKE_FWD, SMOKE_BWD) if args.smoke else (FWD_TILES, BWD_TILES)
    m = args.m or (64 if args.smoke else 8192)
    iters = args.iters or (2 if args.smoke else 20)
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
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
