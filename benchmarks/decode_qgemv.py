"""The quantised decode GEMV (pallas_kernels/decode_gemv/quant_kernel.py) on the GPU: checked against the plain
decode GEMV's reference on the decoded values, then timed at one row against the two paths it is set against, per
linear of a decoder layer (issue 39 item 1: "the quantised GEMV beats bf16 at one row for every model size").

    python benchmarks/decode_qgemv.py                        # GPU: qwen3-0.6b and qwen3-8b, q4_k, one row
    python benchmarks/decode_qgemv.py --formats q4_k,q8_0 --bns 4,8,16,32 --warps 4,8
    python benchmarks/decode_qgemv.py --smoke                # CPU: interpret mode, the check only

Per shape and linear (qkv with the attention RMSNorm, o with the residual, gate_up with the MLP RMSNorm and
silu(gate) * up, down with the residual), --layers layers stacked (past the L2 cache), one jitted call running each
layer's product in turn; µs per linear:
    quant[bn,w]  GemvQuant's kernel with the fusions (what SUROJAX_DECODE_GEMV=pallas serves a quantised model with)
    laid_out     today's default for a quantised model: the fused GEMM's decode form on the LaidOut layout
                 (SUROJAX_QUANT_MATMUL=pallas: pad to 16 rows, split K, the partial sums' reduction), the norm,
                 activation and residual as XLA ops around it
    bf16         the plain decode GEMV on the same shape in bf16 with the same fusions (the bar to beat)
and the bytes each reads (the layout's, or bf16's) as TB/s.
Expected (before the run): quant at ~0.75 / 2 of bf16's bytes, so ~1.5-2.5x faster than bf16 where the plain kernel
reaches ~1.7 TB/s (0.6B's 705 µs of GEMVs a token, session 25), unless decoding bounds it (the 4-bit unpack and the
scale broadcast per value: ~6 integer / fp ops a value against the FMA's 1).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.decode_gemv.api import decode_gemv, decode_gemv_quant, quant_bk  # noqa: E402
from pallas_kernels.decode_gemv.quant_kernel import QuantRows, pack_rows, unpack_rows  # noqa: E402
from pallas_kernels.decode_gemv.reference import decode_gemv_ref  # noqa: E402
from surojax.quant.random_weights import random_weight  # noqa: E402

# shape -> (D, q width, kv width, F)
SHAPES = {"qwen3-0.6b": (1024, 2048, 1024, 3072), "qwen3-8b": (4096, 4096, 1024, 12288), "smoke": (256, 256, 128, 512)}


def linears(shape: str) -> dict[str, tuple[int, int, dict]]:
    """name -> (K, N, fused form)."""
    d, q, kv, f = SHAPES[shape]
    return {"qkv": (d, q + 2 * kv, dict(norm="plain")), "o": (q, d, dict(residual=True)),
            "gate_up": (d, 2 * f, dict(norm="plain", activation="silu")), "down": (f, d, dict(residual=True))}


def stack_rows(w) -> QuantRows:
    """A stacked quantised weight (leaves [L, ...]) -> QuantRows with arrays [L N, ·]."""
    spec, (k, _) = w.kernel_spec, w.shape
    rows = jax.jit(jax.vmap(lambda v: pack_rows(spec, *v.kernel_values(), quant_bk(spec, k))))(w)
    flat = lambda a: None if a is None else a.reshape(-1, a.shape[-1])  # noqa: E731
    return QuantRows(flat(rows.codes), flat(rows.scale), flat(rows.offset), spec=spec, k=k, bk=rows.bk)


def check(fmt, shape, name, k, n, form, interpret) -> dict:
    w = random_weight(fmt, k, n, jax.random.key(0), (2,))
    rows = stack_rows(w)
    wt = unpack_rows(jax.tree.map(lambda a: a.reshape(2, n, -1)[1], rows))  # layer 1, [N, K]
    x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32).astype(jnp.bfloat16)
    nw = (1 + 0.1 * jax.random.normal(jax.random.key(2), (k,), jnp.float32)).astype(jnp.bfloat16)
    n_out = n // 2 if form.get("activation") else n
    r = jax.random.normal(jax.random.key(3), (1, n_out), jnp.float32).astype(jnp.bfloat16)
    kw = dict(norm_weight=nw if form.get("norm") else None, norm=form.get("norm"), activation=form.get("activation"),
              residual=r if form.get("residual") else None)
    got = decode_gemv_quant(x, rows, n=n, layer=1, interpret=interpret, **kw).astype(jnp.float32)
    want = decode_gemv_ref(x, wt, norm=kw["norm_weight"], activation=kw["activation"],
                           residual=kw["residual"]).astype(jnp.float32)
    unit = float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.abs(want).max())
    err = float(jnp.abs(got - want).max())
    ok = err <= 2 * unit
    print(f"[{'PASS' if ok else 'FAIL'}] {fmt} {shape} {name} [{k} -> {n}]: max|kernel-ref| {err:.3g}, unit {unit:.3g}",
          flush=True)
    return dict(kind="check", format=fmt, shape=shape, linear=name, err=err, unit=unit, ok=ok)


def time_linear(fmt, shape, name, k, n, form, layers, iters, bns, warps) -> list[dict]:
    from timing import timeit

    from pallas_kernels.quant_matmul.api import quant_matmul
    from surojax.quant.laid_out import lay_out

    gated = bool(form.get("activation"))
    n_out = n // 2 if gated else n
    w = random_weight(fmt, k, n, jax.random.key(0), (layers,))
    rows = stack_rows(w)
    laid = lay_out(w)
    wt_bf16 = (0.02 * jax.random.normal(jax.random.key(5), (layers, n, k), jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32).astype(jnp.bfloat16)
    nw = jnp.ones((k,), jnp.bfloat16) if form.get("norm") else None
    r = jnp.zeros((1, n_out), jnp.bfloat16) if form.get("residual") else None
    fuse = dict(norm_weight=nw, norm=form.get("norm"), activation=form.get("activation"), residual=r)

    def xla_ops(y):  # what surrounds the fused GEMM's decode form today (activation and residual as XLA ops)
        if gated:
            g, u = jnp.split(y, 2, axis=-1)
            y = jax.nn.silu(g) * u
        return y + r if r is not None else y

    def rms(x):
        x32 = x.astype(jnp.float32)
        return (nw.astype(x.dtype) * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
                                      ).astype(x.dtype)) if nw is not None else x

    def loop(one):
        def f(x, weights):
            acc = jnp.zeros((1, n_out), jnp.float32)
            for i in range(layers):
                acc = acc + one(x, weights, i).astype(jnp.float32)
            return acc
        return jax.jit(f)

    variants = [(f"quant[bn{bn},w{wp}]", loop(lambda x, q, i, bn=bn, wp=wp: decode_gemv_quant(
        x, q, n=n, layer=i, bn=bn, num_warps=wp, **fuse)), rows, rows_bytes(rows) / layers)
        for bn in bns for wp in warps]
    variants.append(("laid_out", loop(lambda x, lw, i: xla_ops(quant_matmul(rms(x), lw.at_layer(jnp.int32(i)),
                                                                             "pallas"))),
                     laid, sum(a.nbytes for a in jax.tree.leaves(laid)) / layers))
    variants.append(("bf16", loop(lambda x, wt, i: decode_gemv(x, wt, layer=i, **fuse)), wt_bf16, n * k * 2))
    out = []
    for label, fn, arg, per_layer in variants:
        try:
            us = timeit(fn, x, arg, iters=iters) / layers * 1e6
        except Exception as exc:  # a variant that does not compile: say so, time the rest
            print(f"# {fmt} {shape} {name} {label} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        row = dict(kind="time", format=fmt, shape=shape, linear=name, variant=label, us=us,
                   mb=per_layer / 1e6, tb_per_s=per_layer / (us * 1e-6) / 1e12, device=jax.devices()[0].device_kind)
        print("RESULT " + json.dumps(row), flush=True)
        out.append(row)
    return out


def rows_bytes(rows: QuantRows) -> int:
    return sum(a.nbytes for a in (rows.codes, rows.scale, rows.offset) if a is not None)


def table(results: list[dict]) -> str:
    cols = ["format", "shape", "linear", "variant", "us", "mb", "tb_per_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        if r["kind"] == "time":
            lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--formats", default="q4_k")
    p.add_argument("--bns", default="4,8,16", help="comma list of output columns per program")
    p.add_argument("--warps", default="4", help="comma list of num_warps")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU: interpret mode, tiny shapes, the check only")
    a = p.parse_args(argv)
    if not a.smoke and jax.default_backend() != "gpu":
        print("decode_qgemv: no GPU (use --smoke on a CPU)", file=sys.stderr)
        return 2
    shapes = ["smoke"] if a.smoke else a.shapes.split(",")
    bns, warps = [int(v) for v in a.bns.split(",")], [int(v) for v in a.warps.split(",")]
    results = []
    for fmt in a.formats.split(","):
        for shape in shapes:
            for name, (k, n, form) in linears(shape).items():
                results.append(check(fmt, shape, name, k, n, form, interpret=a.smoke))
                if not a.smoke:
                    results += time_linear(fmt, shape, name, k, n, form, a.layers, a.iters, bns, warps)
    print()
    print(table(results))
    ok = all(r["ok"] for r in results if r["kind"] == "check")
    print("RESULT " + json.dumps({"checks_ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
