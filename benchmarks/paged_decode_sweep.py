"""Tune the Pallas paged decode-attention kernel (``pallas_kernels/paged_decode/``) on one GPU: a grid of
its knobs (qk, split, blocks_per_iter, min_programs, num_warps, num_stages) over the serving shapes.

    PYTHONPATH=$PWD python benchmarks/paged_decode_sweep.py            # H200: Qwen3-0.6B shapes, < 3 minutes
    PYTHONPATH=$PWD python benchmarks/paged_decode_sweep.py --rows 64 --contexts 576 --configs 0,1,5
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/paged_decode_sweep.py --smoke   # CPU, interpret mode
    PYTHONPATH=$PWD python benchmarks/paged_decode_sweep.py --configs 22 --merges xla,pallas   # the merge's cost

Shapes: Qwen3-0.6B attention (16 query heads, 8 kv heads, head_dim 128, block size 16, bf16 pool), R rows in
{1, 16, 64} x context in {576, 2048}. Each row holds a random length in [context / 2, context] (row 0: the whole
context) in blocks scattered over the pool; the block table is as wide as the runner's context bucket (768 /
3072 slots: its padding is there too). The pool has 28 layers, or fewer where 28 would pass the kernel's 2^31
elements (R = 64 at 2048: the layer count is printed).

Per shape: the pure-jnp reference (fp32) once, at layer 0. Per (shape, config), one compiled program: one call
at layer 0 (checked: max |out - ref| / max |ref| <= 2e-2, else the config FAILS), then --inner calls cycling over
the pool's layers (each call reads another layer's K/V, as the 28 layers of a token step do; no L2 reuse),
timed --repeats times (median). A call = the whole ``paged_decode_attention`` (the Pallas kernel, the partition
merge and its small jnp ops). GB/s = bytes of the rows' real K/V (sum of lengths x K x H x 2 (k, v) x 2 bytes)
/ time per call. Programs compile in parallel threads first (--workers), then run one at a time.

Output: one JSON line per (shape, config) (``{"shape": ..., "config": ..., "us": ..., "gbps": ...}``), then per
shape a table sorted by time (with the speed-up over config 0, today's defaults), then ``BEST <shape>: <knobs>``
lines. A config that does not compile or fails the check prints its error and the rest go on.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.paged_decode import api as pd  # noqa: E402
from pallas_kernels.paged_decode.reference import paged_decode_reference  # noqa: E402
from surojax.serve.runner import _context_bucket  # noqa: E402

# config 0 (the "vs #0" column): the kernel's knobs before this sweep ran on the H200 (2026-11-29), kept fixed
# so the grid stays the one measured; the winner there (config 22) is now the module's default
DEFAULT = dict(qk="dot", split="table", blocks_per_iter=4, min_programs=1024, num_warps=4, num_stages=2)
_CHANGES = [
    # one knob at a time around today's defaults
    dict(split="length"), dict(blocks_per_iter=2), dict(blocks_per_iter=8), dict(num_warps=2), dict(num_warps=8),
    dict(num_stages=1), dict(num_stages=3),
    dict(min_programs=256), dict(min_programs=512), dict(min_programs=2048), dict(min_programs=4096),
    # balanced partitions (split="length") with more programs, more warps, longer / shorter iterations
    dict(split="length", min_programs=2048), dict(split="length", min_programs=4096),
    dict(split="length", num_warps=8), dict(split="length", num_warps=8, min_programs=2048),
    dict(split="length", blocks_per_iter=8, num_warps=8), dict(split="length", blocks_per_iter=8, num_warps=8,
                                                                min_programs=2048),
    dict(split="length", blocks_per_iter=2, min_programs=4096),
    dict(split="length", blocks_per_iter=2, num_stages=3, min_programs=4096),
    dict(split="length", blocks_per_iter=2, num_warps=2, min_programs=4096),
    # multiply + sum scores (no 16-row padding, no MMA, k/v prefetched one iteration ahead); registers bound
    # blocks_per_iter x warps (offline ptxas, sm_90, R = 64: it1 w1 164 regs, w2 182, w4 128; it2 w1 255, w4 183,
    # w8 127; it4 w8 185); with one warp no reduction crosses warps (no barriers)
    dict(qk="fma", split="length", blocks_per_iter=1),
    dict(qk="fma", split="length", blocks_per_iter=1, num_warps=1),
    dict(qk="fma", split="length", blocks_per_iter=1, num_warps=1, min_programs=4096),
    dict(qk="fma", split="length", blocks_per_iter=1, num_warps=2, min_programs=2048),
    dict(qk="fma", split="length", blocks_per_iter=2, num_warps=1, min_programs=2048),
    dict(qk="fma", split="length", blocks_per_iter=2, min_programs=2048),
    dict(qk="fma", split="length", blocks_per_iter=2, num_warps=8),
    dict(qk="fma", split="length", blocks_per_iter=2, num_warps=8, min_programs=4096),
    dict(qk="fma", split="length", blocks_per_iter=4, num_warps=8, min_programs=2048),
    dict(qk="fma", split="table", blocks_per_iter=1, num_warps=1),
]
GRID = [DEFAULT] + [{**DEFAULT, **c} for c in _CHANGES]
SMOKE_GRID = [DEFAULT, {**DEFAULT, "split": "length", "blocks_per_iter": 2},
              {**DEFAULT, "qk": "fma", "split": "length", "blocks_per_iter": 1}]
QWEN3_06B = dict(layers=28, heads=16, kv_heads=8, head_dim=128, block_size=16)
SMOKE_MODEL = dict(layers=3, heads=4, kv_heads=2, head_dim=32, block_size=16)
REL_TOL = 2e-2


def label(cfg: dict) -> str:
    return (f"{cfg['qk']}/{cfg['split']} it{cfg['blocks_per_iter']} mp{cfg['min_programs']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}" + (f" {cfg['merge']}" if "merge" in cfg else ""))


def with_merges(grid: list[dict], merges: list[str]) -> list[dict]:
    """Each config once per partition merge (--merges; none given: the module's default, no `merge` key)."""
    return [{**cfg, "merge": m} for cfg in grid for m in merges] if merges else list(grid)


def is_base(knobs: dict, merges: list[str]) -> bool:
    """Config 0 (with the first --merges entry): the row the "vs #0" column compares with."""
    return ({k: v for k, v in knobs.items() if k != "merge"} == DEFAULT
            and knobs.get("merge") == (merges[0] if merges else None))


def make_case(R: int, context: int, m: dict, dtype, rng: np.random.Generator):
    """q [R, N, H], pools k/v [L, NBLK * bs, K, H], block table [R, NB] (the runner's bucket), lengths [R]."""
    bs, K, H, N = m["block_size"], m["kv_heads"], m["head_dim"], m["heads"]
    lengths = rng.integers(context // 2, context + 1, R)
    lengths[0] = context
    NB = _context_bucket(context + 1, bs, bs) // bs
    per_row = -(-lengths // bs)
    nblk = int(per_row.sum()) + 8
    L = min(m["layers"], pd.max_pool_blocks(1, bs, K, H) // nblk)  # layers of nblk blocks under 2^31 elements
    if L < 1:
        raise ValueError(f"paged_decode_sweep: R={R} x context {context} needs {nblk} blocks, more than the "
                         f"kernel's 2^31-element pool allows for one layer")
    perm = rng.permutation(nblk)
    table = np.zeros((R, NB), np.int32)
    at = 0
    for r in range(R):
        table[r, :per_row[r]] = perm[at:at + per_row[r]]
        at += per_row[r]
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    k_pool = jax.random.normal(kk, (L, nblk * bs, K, H), dtype)
    v_pool = jax.random.normal(kv, (L, nblk * bs, K, H), dtype)
    q = jax.random.normal(kq, (R, N, H), dtype)
    real_bytes = int(lengths.sum()) * K * H * 2 * jnp.dtype(dtype).itemsize
    return q, k_pool, v_pool, jnp.asarray(table), jnp.asarray(lengths, jnp.int32), real_bytes


def program(cfg: dict, block_size: int, inner: int, interpret: bool | None):
    """One call at layer 0 (for the check), then `inner` calls at layers 1, 2, ... (mod L), their outputs summed
    (so none is dead code). Returns (out at layer 0, the sum)."""
    def run(q, k_pool, v_pool, table, lengths):
        L = k_pool.shape[0]

        def attend(layer):
            return pd.paged_decode_attention(q, k_pool, v_pool, layer, table, lengths, block_size=block_size,
                                             interpret=interpret, **cfg)

        first = attend(jnp.int32(0))

        def body(i, acc):
            return acc + attend((i + 1) % L).astype(jnp.float32)

        return first, jax.lax.fori_loop(0, inner, body, jnp.zeros(q.shape, jnp.float32))

    return jax.jit(run)


def compile_all(fns: list, args: tuple, workers: int) -> list:
    """Each jitted fn lowered and compiled for `args` in `workers` threads (a failure is retried alone, in case
    threads were the cause); a compiled program or the exception, in order."""
    def build(fn):
        return fn.lower(*args).compile()

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as ex:
        futures = [ex.submit(build, fn) for fn in fns]
    out = []
    for fn, f in zip(fns, futures):
        try:
            out.append(f.result())
        except Exception:  # noqa: BLE001 - retried alone
            try:
                out.append(build(fn))
            except Exception as e:  # noqa: BLE001 - reported per config, the sweep goes on
                out.append(e)
    return out


def measure(fn, args, ref: np.ndarray, inner: int, repeats: int) -> dict:
    """Check the layer-0 call against the reference, then time: {rel_err, us} (raises on a failed check)."""
    first, _ = jax.block_until_ready(fn(*args))
    err = float(np.max(np.abs(np.asarray(first, np.float32) - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    if not np.isfinite(err) or err > REL_TOL:
        raise AssertionError(f"max |out - ref| / max |ref| = {err:.3g} > {REL_TOL}")
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) / (inner + 1))
    return dict(rel_err=err, us=round(statistics.median(times) * 1e6, 2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,16,1", help="comma list of R (in this order)")
    p.add_argument("--contexts", default="576,2048", help="comma list of context lengths")
    p.add_argument("--configs", default="", help="comma list of GRID indices (default: all)")
    p.add_argument("--inner", type=int, default=50, help="calls per timed run (after the checked one)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per config (median)")
    p.add_argument("--workers", type=int, default=8, help="compile threads")
    p.add_argument("--budget-s", type=float, default=170.0, help="no new shape starts after this many seconds")
    p.add_argument("--merges", default="", help="comma list of partition merges (xla, pallas) to run each config "
                                                "with (default: the module's MERGE only)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, 3 configs, Pallas interpret mode")
    a = p.parse_args(argv)
    start = time.perf_counter()
    model, grid, dtype, interpret = QWEN3_06B, GRID, jnp.bfloat16, None
    rows = [int(x) for x in a.rows.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    if a.smoke:
        model, grid, dtype, interpret = SMOKE_MODEL, SMOKE_GRID, jnp.float32, True
        rows, contexts, a.inner, a.repeats, a.workers = [1, 3], [40], 2, 2, 1
    indices = [int(i) for i in a.configs.split(",")] if a.configs else list(range(len(grid)))
    merges = [m.strip() for m in a.merges.split(",") if m.strip()]
    grid = with_merges([grid[i] for i in indices], merges)
    indices = [i for i in indices for _ in (merges or [None])]  # one per row of `grid`
    bs = model["block_size"]
    print(f"# paged decode sweep on {jax.devices()[0].device_kind}: {len(grid)} configs x {len(rows) * len(contexts)} "
          f"shapes, {jnp.dtype(dtype).name} pool, heads {model['heads']}/{model['kv_heads']} x {model['head_dim']}, "
          f"block size {bs}", flush=True)
    pd.prepare()  # Pallas's lazy lowering imports once, before any compile thread starts

    rng = np.random.default_rng(0)
    cases, results = {}, []
    for R in rows:
        for ctx in contexts:
            shape = f"R{R}-ctx{ctx}"
            if time.perf_counter() - start > a.budget_s:
                print(f"# {shape}: SKIPPED (past --budget-s {a.budget_s:.0f})", flush=True)
                continue
            q, k_pool, v_pool, table, lengths, real_bytes = make_case(R, ctx, model, dtype, rng)
            case = cases[shape] = dict(R=R, context=ctx, layers=k_pool.shape[0], table_blocks=table.shape[1],
                                       mean_length=float(np.mean(np.asarray(lengths))), real_bytes=real_bytes)
            args = (q, k_pool, v_pool, table, lengths)
            with jax.default_matmul_precision("highest"):  # fp32 dots, not TF32
                ref = np.asarray(jax.jit(paged_decode_reference, static_argnames="block_size")(
                    q.astype(jnp.float32), k_pool, v_pool, jnp.int32(0), table, lengths, block_size=bs))
            t0 = time.perf_counter()
            compiled = compile_all([program(cfg, bs, a.inner, interpret) for cfg in grid], args, a.workers)
            print(f"# {shape}: pool {k_pool.shape[0]} layers x {k_pool.shape[1] // bs} blocks, table "
                  f"{table.shape[1]} blocks, {real_bytes / 1e6:.1f} MB of real K/V per call; {len(grid)} programs "
                  f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)
            for i, cfg, fn in zip(indices, grid, compiled):
                row = dict(shape=shape, config=i, knobs=cfg, label=label(cfg), **case)
                try:
                    if isinstance(fn, Exception):
                        raise fn
                    row.update(ok=True, **measure(fn, args, ref, a.inner, a.repeats))
                    row["gbps"] = round(real_bytes / (row["us"] * 1e-6) / 1e9, 1)
                except Exception as e:  # noqa: BLE001 - report the config, go on
                    row.update(ok=False, error=f"{type(e).__name__}: "
                                               f"{' | '.join(str(e).strip().splitlines()[:3])[:300]}")
                results.append(row)
                print(json.dumps(row), flush=True)
            del compiled, args, q, k_pool, v_pool
    print(f"# total {time.perf_counter() - start:.0f} s", flush=True)

    for shape in cases:
        rows_ = [r for r in results if r["shape"] == shape]
        base = next((r["us"] for r in rows_ if is_base(r["knobs"], merges) and r["ok"]), None)
        print(f"\n## {shape} (layers {cases[shape]['layers']}, mean length {cases[shape]['mean_length']:.0f}, "
              f"{cases[shape]['real_bytes'] / 1e6:.1f} MB per call)")
        print(f"{'#':>3} {'config':<41} {'us':>9} {'GB/s':>7} {'vs #0':>6} {'rel err':>8}")
        for r in sorted(rows_, key=lambda r: (not r["ok"], r.get("us", 0.0))):
            if r["ok"]:
                speed = f"{base / r['us']:.2f}x" if base else "-"
                print(f"{r['config']:>3} {r['label']:<41} {r['us']:>9.2f} {r['gbps']:>7.0f} {speed:>6} "
                      f"{r['rel_err']:>8.1e}")
            else:
                print(f"{r['config']:>3} {r['label']:<41} FAILED {r['error'][:120]}")
    ok = [r for r in results if r["ok"]]
    for shape in cases:
        best = min((r for r in ok if r["shape"] == shape), key=lambda r: r["us"], default=None)
        print(f"BEST {shape}: " + (json.dumps(best["knobs"]) + f" {best['us']} us {best['gbps']} GB/s"
                                    if best else "none passed"))
    failed = [r for r in results if not r["ok"]]
    return 1 if not ok or (a.smoke and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
