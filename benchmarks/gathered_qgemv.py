"""The gathered quantised GEMV (pallas_kernels/gathered_gemv/quant_kernel.py) compiled on the GPU: checked against
its reference, then timed against the path it replaces, at Qwen3-30B-A3B's expert shapes (issue 39 item 2).

    python benchmarks/gathered_qgemv.py                         # GPU: q4_k, gate_up and down, A = 8, 64, 128
    python benchmarks/gathered_qgemv.py --formats q4_k,q6_k --rows 8 --variants 'fma,64,0,4;dot,64,0,4'
    python benchmarks/gathered_qgemv.py --smoke                 # CPU: interpret mode, tiny shapes, check only

For each format, projection and A (assignments = tokens x k):
    check   the kernel (one variant after another) against pallas_kernels.gathered_gemv.reference on real
            quantised values (random codes: surojax.quant.random_weights), bf16 x, at layer L-1 of a 2-layer
            stack: max |kernel - ref| <= 2 units of bf16 at the largest |ref| (both round fp32 sums once)
    time    --layers layers of E experts (past the L2 cache), one jitted call that runs each layer's product with
            its own routed ids; µs per layer:
              xla      today's path: the layer's native blocks gathered (`take_experts`), dequantised to bf16
                       ([A, K, N] written), multiplied row by row (pallas_kernels.grouped_matmul.gathered_dot)
              <variant> the kernel on the stack laid out once (codes + fp32 scales / offsets), read in place
            and the routed bytes each implies (native blocks for xla, the layout's for the kernel)
Expected (before the run): one user (A = 8) at ~10-15 µs for gate_up + down together against xla's ~60 µs
(sessions 21 / 26: 62-68 µs a whole Q4_K MoE layer), because the kernel reads 8 x 4.7 M values x 0.75 bytes
= 28 MB where xla writes and reads ~150 MB of bf16. Prints `RESULT {json}` lines and a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gathered_gemv.quant_kernel import QuantGatheredTiles, gathered_quant_kernel  # noqa: E402
from pallas_kernels.gathered_gemv.reference import gathered_layout_ref  # noqa: E402
from pallas_kernels.grouped_matmul.gathered import gathered_dot  # noqa: E402
from surojax.quant.random_weights import random_weight  # noqa: E402

# name -> (K, N, E): Qwen3-30B-A3B's experts (hidden 2048, expert width 768: gate_up 2048 -> 1536, down 768 -> 2048)
SHAPES = {"gate_up": (2048, 1536, 128), "down": (768, 2048, 128)}
SMOKE = {"gate_up": (256, 64, 6), "down": (256, 32, 6)}
DEFAULT_VARIANTS = "fma,64,0,4;fma,128,0,4;fma,32,0,4;dot,64,0,4;dot,128,0,8;fma,64,1,4"


def lay_out_stack(w, kt: int = 128):
    """A quantised weight with leaves [L, E, ...] -> its KernelLayout with arrays [L E, ...] (one pass)."""
    lw = jax.jit(jax.vmap(jax.vmap(lambda v: v.kernel_layout(kt))))(w)
    flat = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])  # noqa: E731
    return dataclasses.replace(lw, codes=flat(lw.codes), scale=flat(lw.scale), offset=flat(lw.offset))


def parse_variants(text: str) -> list[QuantGatheredTiles]:
    out = []
    for v in text.split(";"):
        body, bn, splits, warps = v.split(",")
        out.append(QuantGatheredTiles(bn=int(bn), splits=int(splits), body=body, num_warps=int(warps)))
    return out


def check(fmt, name, k, n, e, rows, variants, interpret) -> list[dict]:
    w = random_weight(fmt, k, n, jax.random.key(1), (2, e))
    stack = lay_out_stack(w)
    x = jax.random.normal(jax.random.key(2), (rows, k), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(3), (rows,), 0, e, jnp.int32).at[0].set(0).at[-1].set(0)
    base = jnp.full((1,), e, jnp.int32)  # layer 1 of 2
    ref = np.asarray(gathered_layout_ref(x, stack, ids, base).astype(jnp.float32))
    # the native blocks' own path (today's), as a second witness of the layout
    xla = np.asarray(gathered_dot(x, jax.tree.map(lambda a: a[1], w), ids).astype(jnp.float32))
    unit = float(jnp.finfo(jnp.bfloat16).eps) * float(np.abs(ref).max())
    out = []
    for t in variants:
        y = np.asarray(gathered_quant_kernel(x, stack, ids, base, num_experts=e, tiles=t,
                                             interpret=interpret).astype(jnp.float32))
        err, err_xla = float(np.abs(y - ref).max()), float(np.abs(xla - ref).max())
        ok = err <= 2 * unit and err_xla <= 2 * unit
        r = dict(kind="check", format=fmt, proj=name, rows=rows, variant=t.label(), err=err, err_xla=err_xla,
                 unit=unit, ok=ok)
        print(f"[{'PASS' if ok else 'FAIL'}] {fmt} {name} A={rows} {t.label()}: max|kernel-ref| {err:.3g}, "
              f"max|xla-ref| {err_xla:.3g}, unit {unit:.3g}", flush=True)
        out.append(r)
    return out


def time_rows(fmt, name, k, n, e, rows, variants, layers, iters) -> list[dict]:
    from timing import timeit

    w = random_weight(fmt, k, n, jax.random.key(1), (layers, e))
    stack = lay_out_stack(w)
    x = jax.random.normal(jax.random.key(2), (rows, k), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(4), (layers, rows), 0, e, jnp.int32)
    native_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(w)) / (layers * e)
    layout_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(stack)) / (layers * e)

    def xla_fn(x, w, ids):
        acc = jnp.zeros((rows, n), jnp.float32)
        for i in range(layers):
            acc = acc + gathered_dot(x, jax.tree.map(lambda a: a[i], w), ids[i]).astype(jnp.float32)
        return acc

    def kernel_fn(t):
        def f(x, stack, ids):
            acc = jnp.zeros((rows, n), jnp.float32)
            for i in range(layers):
                acc = acc + gathered_quant_kernel(x, stack, ids[i], jnp.full((1,), i * e, jnp.int32),
                                                  num_experts=e, tiles=t).astype(jnp.float32)
            return acc
        return f

    out = []
    for label, fn, arg, per_expert in [("xla", xla_fn, w, native_bytes)] + \
            [(t.label(), kernel_fn(t), stack, layout_bytes) for t in variants]:
        try:
            us = timeit(jax.jit(fn), x, arg, ids, iters=iters) / layers * 1e6
        except Exception as exc:  # a variant Triton refuses: say so, time the others
            print(f"# {fmt} {name} A={rows} {label} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        mb = rows * per_expert / 1e6
        r = dict(kind="time", format=fmt, proj=name, rows=rows, variant=label, us_per_layer=us, mb_routed=mb,
                 tb_per_s=mb / 1e6 / (us * 1e-6), device=jax.devices()[0].device_kind)
        print("RESULT " + json.dumps(r), flush=True)
        out.append(r)
    return out


def table(results: list[dict]) -> str:
    cols = ["format", "proj", "rows", "variant", "us_per_layer", "mb_routed", "tb_per_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        if r["kind"] == "time":
            lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols)
                         + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="q4_k")
    p.add_argument("--rows", default="8,64,128", help="comma list of assignments A (tokens x k)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="';'-separated body,bn,splits,num_warps "
                   "(splits 0: enough programs for the GPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU: interpret mode, tiny shapes, the check only")
    a = p.parse_args(argv)
    if not a.smoke and jax.default_backend() != "gpu":
        print("gathered_qgemv: no GPU (use --smoke on a CPU)", file=sys.stderr)
        return 2
    variants = parse_variants(a.variants)
    shapes = SMOKE if a.smoke else SHAPES
    rows = [4] if a.smoke else [int(r) for r in a.rows.split(",")]
    results = []
    for fmt in a.formats.split(","):
        for name, (k, n, e) in shapes.items():
            results += check(fmt, name, k, n, e, rows[0], variants, interpret=a.smoke)
            if not (a.smoke or a.no_time):
                for r in rows:
                    results += time_rows(fmt, name, k, n, e, r, variants, a.layers, a.iters)
    print()
    print(table(results))
    print("RESULT " + json.dumps({"checks_ok": all(r["ok"] for r in results if r["kind"] == "check")}))
    return 0 if all(r["ok"] for r in results if r["kind"] == "check") else 1


if __name__ == "__main__":
    sys.exit(main())
