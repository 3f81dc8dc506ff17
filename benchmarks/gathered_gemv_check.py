"""The gathered GEMV kernel compiled on the GPU (pallas_kernels/gathered_gemv) against a float64 reference and XLA's
gathered product, at Qwen3-30B-A3B's expert shapes (the CPU tests run it in interpret mode at small shapes).

    python benchmarks/gathered_gemv_check.py                 # GPU: both projections, rows x k = 8 .. 64, bf16
    python benchmarks/gathered_gemv_check.py --smoke         # CPU: interpret mode, tiny shapes

For each case, y = x @ w[ids] per assignment row, in x's dtype, from:
    kernel   gathered_gemv (one layer [E, I, O], and the layer stack [L, E, I, O] read in place at a layer index)
    xla      pallas_kernels.grouped_matmul.gathered.gathered_dot(kernel="xla"), the path the kernel replaces
    truth    float64 numpy (w rounded to x's dtype, exact products and sums)
PASS iff max |kernel - truth| <= 2 * max |xla - truth| + one unit of x's dtype at the largest |truth| (both sum
fp32 products in some order and round once to x's dtype; the kernel may not be worse than XLA by more than that
rounding), and the stack form equals the one-layer form bit for bit. Prints one line per case, `RESULT {json}`,
and exits 1 on a failure.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gathered_gemv import gathered_gemv  # noqa: E402
from pallas_kernels.grouped_matmul.gathered import gathered_dot  # noqa: E402

# name -> (I, O, E, L): Qwen3-30B-A3B's experts (hidden 2048, expert width 768, 128 experts), a 2-layer stack
SHAPES = {"gate_up": (2048, 1536, 128, 2), "down": (768, 2048, 128, 2)}
SMOKE = {"gate_up": (64, 96, 6, 2), "down": (48, 64, 6, 2)}


def check(name: str, i: int, o: int, e: int, layers: int, rows: int, dtype, seed: int = 0) -> dict:
    kx, kw, ki = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, i), jnp.float32).astype(dtype)
    stack = (jax.random.normal(kw, (layers, e, i, o), jnp.float32) * 0.02).astype(dtype)
    ids = jax.random.randint(ki, (rows,), 0, e, jnp.int32).at[-1].set(0).at[0].set(0)  # expert 0 routed twice
    layer = layers - 1
    w = stack[layer]
    one = jax.jit(lambda x, w, ids: gathered_gemv(x, w, ids))(x, w, ids)
    in_place = jax.jit(lambda x, s, ids, l: gathered_gemv(x, s, ids, layer=l))(x, stack, ids, jnp.int32(layer))
    xla = jax.jit(lambda x, w, ids: gathered_dot(x, w, ids, kernel="xla"))(x, w, ids)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)[np.asarray(ids)]
    truth = np.einsum("ai,aio->ao", np.asarray(x.astype(jnp.float32), np.float64), w64)
    err = float(np.abs(np.asarray(one.astype(jnp.float32), np.float64) - truth).max())
    err_xla = float(np.abs(np.asarray(xla.astype(jnp.float32), np.float64) - truth).max())
    unit = float(jnp.finfo(dtype).eps) * float(np.abs(truth).max())
    same = bool(np.array_equal(np.asarray(one), np.asarray(in_place)))
    ok = err <= 2 * err_xla + unit and same
    out = {"case": f"{name} A={rows}", "I": i, "O": o, "E": e, "dtype": jnp.dtype(dtype).name, "err": err,
           "err_xla": err_xla, "unit": unit, "stack_equal": same, "ok": ok}
    print(f"[{'PASS' if ok else 'FAIL'}] {out['case']:16s} I={i} O={o} E={e} {out['dtype']}: max|kernel-truth| "
          f"{err:.3g}, max|xla-truth| {err_xla:.3g}, unit {unit:.3g}, stack == layer: {same}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,32,64", help="comma list of assignment rows A (tokens x k)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--smoke", action="store_true", help="CPU: interpret mode, tiny shapes")
    a = p.parse_args(argv)
    if not a.smoke and jax.default_backend() != "gpu":
        print("gathered_gemv_check: no GPU (use --smoke on a CPU)", file=sys.stderr)
        return 2
    shapes = SMOKE if a.smoke else SHAPES
    results = [check(name, *dims, rows=int(r), dtype=jnp.dtype(d))
               for name, dims in shapes.items() for r in a.rows.split(",") for d in a.dtypes.split(",")]
    print("RESULT " + json.dumps({"device": str(jax.devices()[0].device_kind), "cases": results}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
