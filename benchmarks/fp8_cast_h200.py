"""Tile sweep of the one-pass FP8 cast kernel (pallas_kernels/fp8_cast) at the 8B training step's shapes.

Session 10 (benchmarks/RESULTS.md): 1,008 `fp8_cast_transpose` launches take 41 ms of the fp8 Qwen3-8B full step,
the 50M-element ones ~90 µs, i.e. ~2.2 TB/s of a bf16 input with the default 64 x 64 tiles (4 warps), against
~4.3 TB/s for a device-to-device copy. This times every tile in TILES on each operand shape below, checks each
result bit for bit against the pure-jnp reference, and prints µs, the bytes moved per second (input read + both
FP8 layouts written) and the best tile per shape; the reference (XLA's three passes) is the last row of a shape.

    operand        shape [R, C]    dtype     what it is in the Qwen3-8B step (seq 4096, batch 1)
    x of q/k/v     4096 x 4096     bf16      a layer input (E4M3)
    x of down      4096 x 12288    bf16      SiLU(gate) * up (E4M3)
    dy of gate/up  4096 x 12288    bf16      the MLP's output gradients (E5M2)
    W of gate/up   4096 x 12288    fp32      a trainable weight, fp32 master (E4M3)
    W of down      12288 x 4096    fp32

    python3 benchmarks/fp8_cast_h200.py               # H200: every tile x shape, ~1 min
    python3 benchmarks/fp8_cast_h200.py --smoke       # CPU: interpret mode, small shapes, the checks only
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_cast import CastTiles, cast_transpose, cast_transpose_reference
from timing import timeit

SHAPES = [("x q/k/v", (4096, 4096), jnp.bfloat16, jnp.float8_e4m3fn, 448.0),
          ("x down", (4096, 12288), jnp.bfloat16, jnp.float8_e4m3fn, 448.0),
          ("dy gate/up", (4096, 12288), jnp.bfloat16, jnp.float8_e5m2, 57344.0),
          ("W gate/up fp32", (4096, 12288), jnp.float32, jnp.float8_e4m3fn, 448.0),
          ("W down fp32", (12288, 4096), jnp.float32, jnp.float8_e4m3fn, 448.0)]
TILES = [CastTiles(64, 64, 4), CastTiles(32, 128, 4), CastTiles(64, 128, 4), CastTiles(128, 64, 4),
         CastTiles(128, 128, 4), CastTiles(128, 128, 8), CastTiles(64, 256, 8), CastTiles(256, 64, 8),
         CastTiles(256, 128, 8)]
SMOKE_SHAPES = [(name, (128, 256), dt, fmt, bound) for name, _, dt, fmt, bound in SHAPES[1:4]]
SMOKE_TILES = [CastTiles(32, 64, 4), CastTiles(64, 128, 4)]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU: interpret mode on small shapes, checks only")
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args(argv)
    shapes, tiles = (SMOKE_SHAPES, SMOKE_TILES) if a.smoke else (SHAPES, TILES)
    print(f"# fp8_cast tile sweep on {jax.devices()[0].device_kind}", flush=True)
    rows, failed = [], 0
    for name, shape, dtype, fmt, bound in shapes:
        x = (jax.random.normal(jax.random.key(0), shape, jnp.float32) * 3.0).astype(dtype)
        inv = jnp.float32(bound / float(jnp.max(jnp.abs(x.astype(jnp.float32)))))
        want = jax.jit(cast_transpose_reference, static_argnums=(2, 3))(x, inv, fmt, bound)
        moved = x.size * (jnp.dtype(dtype).itemsize + 2)  # read once, write q and q^T (1 byte each)
        variants = [(f"{t.tr}x{t.tc} w{t.num_warps}", t) for t in tiles] + [("xla reference", None)]
        best = None
        for label, t in variants:
            if t is None:
                fn = jax.jit(lambda x, inv: cast_transpose_reference(x, inv, fmt, bound))
            else:
                fn = jax.jit(lambda x, inv, t=t: cast_transpose(x, inv, fmt, bound, tiles=t, use_kernel=True))
            try:
                got = fn(x, inv)
                ok = all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want))
                us = None if a.smoke else timeit(fn, x, inv, iters=a.iters) * 1e6
            except Exception as e:  # noqa: BLE001 - a tile Triton cannot compile (shared memory) is one row
                rows.append((name, label, "ERROR", None, None, f"{type(e).__name__}: {str(e)[:80]}"))
                failed += 1
                continue
            failed += not ok
            tbs = None if us is None else moved / (us * 1e-6) / 1e12
            rows.append((name, label, "ok" if ok else "FAIL", us, tbs, ""))
            if ok and us is not None and t is not None and (best is None or us < best[1]):
                best = (label, us)
        if best:
            print(f"# {name} {shape} {jnp.dtype(dtype).name} -> {jnp.dtype(fmt).name}: best {best[0]} "
                  f"{best[1]:.1f} µs", flush=True)
    print("\n| operand | tiles | check | µs | TB/s | note |\n|---|---|---|---|---|---|")
    for name, label, check, us, tbs, note in rows:
        print(f"| {name} | {label} | {check} | {'' if us is None else f'{us:.1f}'} | "
              f"{'' if tbs is None else f'{tbs:.2f}'} | {note} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
