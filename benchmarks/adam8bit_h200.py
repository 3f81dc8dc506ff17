"""Tile sweep of the fused 8-bit AdamW kernel (pallas_kernels/adam8bit) at the Qwen3-8B layers' shapes.

Session 13 (benchmarks/RESULTS.md): the kernel with 16 blocks x 4 warps moves ~2.5 TB/s on the 8B step's stacked
gate / up / down kernels (35 ms of the step). This times each tile on one stacked leaf ([L, K, N] fp32 params,
fp32 gradient sums, 8-bit moments), checks every tile's result against the first (the same arithmetic: equal
bits), and prints µs, TB/s (16 bytes per parameter: g, p, p', codes in and out) and the best tile.

    python3 benchmarks/adam8bit_h200.py                 # H200, ~1 min
    python3 benchmarks/adam8bit_h200.py --smoke         # CPU: interpret mode, a small leaf, the checks only
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.adam8bit import BLOCK, Adam8bitHyper, Adam8bitTiles, adam8bit_kernel
from surojax.train.optim_8bit import SIGNED_MAP, UNSIGNED_MAP, quantize_blockwise
from surojax.train.optim_8bit_fused import _tables
from timing import timeit

TILES = [Adam8bitTiles(8, 4), Adam8bitTiles(16, 4), Adam8bitTiles(16, 8), Adam8bitTiles(32, 4), Adam8bitTiles(32, 8),
         Adam8bitTiles(64, 8), Adam8bitTiles(4, 2), Adam8bitTiles(8, 2)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    L, K, N = (2, 64, 256) if a.smoke else (36, 4096, 12288)
    tiles = TILES[:2] if a.smoke else TILES
    interpret = jax.default_backend() != "gpu"
    rows_per_layer = K * N // BLOCK
    key = jax.random.split(jax.random.key(0), 3)
    g = jax.random.normal(key[0], (L * rows_per_layer, BLOCK), jnp.float32)
    w = jax.random.normal(key[1], (L * rows_per_layer, BLOCK), jnp.float32) * 0.02
    m = quantize_blockwise(jax.random.normal(key[2], (L * rows_per_layer * BLOCK,)) * 1e-3, SIGNED_MAP)
    v = quantize_blockwise(jnp.abs(jax.random.normal(key[2], (L * rows_per_layer * BLOCK,))) * 1e-6, UNSIGNED_MAP)
    scal = jnp.tile(jnp.asarray([[0.1, 0.001, -1e-5, 0.0]], jnp.float32), (L, 1))
    glob = jnp.asarray([1.0, 2.0], jnp.float32)
    hyper = Adam8bitHyper(0.9, 0.999, 1e-8, 0.1, 1.0)
    tables = _tables()
    print(f"# adam8bit tile sweep on {jax.devices()[0].device_kind}: [{L}, {K}, {N}] ({L * K * N / 1e9:.2f} G params)")
    print("| tiles | check | µs | TB/s |\n|---|---|---|---|")
    first, best = None, None
    n = 1 if a.smoke else 5  # kernel calls per timed call: a loop carrying the state, so the writes are in place

    for t in tiles:
        def run(state, consts, t=t):  # the operands as arguments: closed over, 7 GB would become HLO constants
            glob, scal, g, tables = consts

            def body(_, st):
                return adam8bit_kernel(glob, scal, g, *st, tables, hyper=hyper, decay=True,
                                       rows_per_layer=rows_per_layer, tiles=t, interpret=interpret)
            return jax.lax.fori_loop(0, n, body, state)

        f = jax.jit(run)
        state = (w, m.codes, m.absmax, v.codes, v.absmax)
        consts = (glob, scal, g, tables)
        out = jax.block_until_ready(f(state, consts))
        if first is None:
            first = out
        ok = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(out, first))
        sec = timeit(f, state, consts, iters=1 if a.smoke else 3, repeats=1 if a.smoke else 3) / n
        tbs = 16 * L * K * N / sec / 1e12
        print(f"| {t.rows}x256 w{t.num_warps} | {'ok' if ok else 'DIFFERS'} | {sec * 1e6:.0f} | {tbs:.2f} |")
        if ok and (best is None or sec < best[1]):
            best = (t, sec)
    print(f"# best: {best[0].rows} rows x {best[0].num_warps} warps, {best[1] * 1e6:.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
