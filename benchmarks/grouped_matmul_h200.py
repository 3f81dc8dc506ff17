"""The Pallas grouped matmul (pallas_kernels.grouped_matmul) vs jax.lax.ragged_dot on Qwen3-30B-A3B's expert
projections: E = 128 experts, top-8 routing, D = 2048, F = 768, tokens 8192 and 16384 (A = tokens * 8 rows,
sorted by expert). Group sizes come from a random router with a per-expert bias (skewed loads, empty experts
possible), bf16 weights and activations:

    gate, up  x [A, D] @ w [E, D, F] -> [A, F]
    down      h [A, F] @ w [E, F, D] -> [A, D]

(gate and up have one shape: timed once, counted twice in the layer total). Per shape and path: fwd (y) and
fwd+bwd (y, dx, dw via jax.vjp); TFLOP/s counts 2 * A * I * O per product (3 products for fwd+bwd).

First a numeric check of the kernel against ragged_dot on every shape (y, dx, dw: max |a - b| / max |b| below
2e-2, both in bf16 with fp32 accumulation); a failure exits 1 before any timing. Then the kernel's tiles are
tuned on the first shape (GMM_CANDIDATES for y and dx, TGMM_CANDIDATES for dw; a config Triton cannot compile is
printed and skipped) and the best are used everywhere. One JSON line per measurement on stdout, progress on
stderr, the table last.

    PYTHONPATH=$PWD python3 benchmarks/grouped_matmul_h200.py                 # H200, a few minutes
    PYTHONPATH=$PWD python3 benchmarks/grouped_matmul_h200.py --check-only    # numerics only
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 benchmarks/grouped_matmul_h200.py --check-only --tiny   # CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import (GMM_TILES, TGMM_TILES, GmmTiles, TgmmTiles, gmm, grouped_matmul,
                                           grouped_matmul_reference, tgmm)
from timing import timeit  # benchmarks/ is sys.path[0]


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """One MoE layer's expert matmuls: tokens routed to top_k of num_experts; hidden D, expert width F."""

    tokens: int
    num_experts: int = 128
    top_k: int = 8
    hidden: int = 2048
    ffn: int = 768

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k


SHAPES = [MoeShape(8192), MoeShape(16384)]
TINY = [MoeShape(64, num_experts=8, top_k=2, hidden=64, ffn=32)]
# Candidates compiled offline for sm_90 (benchmarks/triton_offline_check.py's `compile` on their Triton IR): all fit
# the H200's shared memory; with 4 warps a 128 x 128 fp32 accumulator spills registers, so the defaults use 8.
GMM_CANDIDATES = [GmmTiles(128, 64, 128, 8, 3), GmmTiles(128, 64, 128, 8, 4), GmmTiles(64, 64, 128, 4, 4),
                  GmmTiles(128, 128, 128, 8, 3), GmmTiles(128, 64, 128, 4, 4)]
TGMM_CANDIDATES = [TgmmTiles(64, 128, 128, 8, 3), TgmmTiles(64, 128, 128, 8, 4), TgmmTiles(128, 128, 128, 8, 3),
                   TgmmTiles(64, 128, 64, 4, 4), TgmmTiles(64, 64, 128, 4, 4)]
TINY_GMM = [GmmTiles(16, 16, 16, 4, 2)]
TINY_TGMM = [TgmmTiles(16, 16, 16, 4, 2)]
MAX_REL_ERR = 2e-2
ROUTER_SKEW = 1.0  # std of the per-expert logit bias: a few hot experts, some nearly idle


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(**rec) -> None:
    print(json.dumps({"bench": "grouped_matmul", **rec}), flush=True)


def router_group_sizes(shape: MoeShape, key) -> jax.Array:
    """[E] int32 rows per expert from a random top-k router with skewed expert popularity (sums to A)."""
    k_logits, k_bias = jax.random.split(key)
    logits = jax.random.normal(k_logits, (shape.tokens, shape.num_experts))
    logits = logits + ROUTER_SKEW * jax.random.normal(k_bias, (shape.num_experts,))
    _, experts = jax.lax.top_k(logits, shape.top_k)  # [T, top_k]
    return jnp.bincount(experts.reshape(-1), length=shape.num_experts).astype(jnp.int32)


def operands(shape: MoeShape, d_in: int, d_out: int, key):
    """x [A, d_in], w [E, d_in, d_out], dy [A, d_out] in bf16, scaled so y and the grads are O(1)."""
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (shape.rows, d_in), jnp.bfloat16)
    w = (jax.random.normal(kw, (shape.num_experts, d_in, d_out)) * d_in ** -0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (shape.rows, d_out), jnp.bfloat16)
    return x, w, dy


def ragged(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)


def pallas(gmm_tiles: GmmTiles, tgmm_tiles: TgmmTiles, interpret: bool | None):
    return lambda x, w, gs: grouped_matmul(x, w, gs, tiles=gmm_tiles, tgmm_tiles=tgmm_tiles, interpret=interpret)


def fwd_bwd(f):
    """jit: (x, w, gs, dy) -> (y, dx, dw)."""
    def run(x, w, gs, dy):
        y, pull = jax.vjp(lambda x, w: f(x, w, gs), x, w)
        return (y, *pull(dy))
    return jax.jit(run)


@jax.jit
def _rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30)


def looped(x, w, gs, dy):
    """(y, dx, dw) by one plain matmul per expert on its static row range (group sizes read on the host): an
    anchor that holds nothing bigger than the operands (XLA's ragged_dot gradient can materialise [A, E, O])."""
    sizes = [int(n) for n in jax.device_get(gs)]

    @jax.jit
    def run(x, w, dy):
        ys, dxs, dws, at = [], [], [], 0
        for e, n in enumerate(sizes):
            xe, dye = x[at:at + n], dy[at:at + n]
            ys.append(jnp.dot(xe, w[e], preferred_element_type=jnp.float32).astype(x.dtype))
            dxs.append(jnp.dot(dye, w[e].T, preferred_element_type=jnp.float32).astype(x.dtype))
            dws.append(jnp.dot(xe.T, dye, preferred_element_type=jnp.float32).astype(w.dtype))
            at += n
        tail = jnp.zeros((x.shape[0] - at, w.shape[2]), x.dtype)
        return (jnp.concatenate(ys + [tail]), jnp.concatenate(dxs + [jnp.zeros((x.shape[0] - at, x.shape[1]), x.dtype)]),
                jnp.stack(dws))

    return run(x, w, dy)


def check(label: str, f, x, w, gs, dy, tiny: bool) -> bool:
    """y, dx, dw of the kernel vs a per-expert loop of plain matmuls (and, on tiny shapes, vs ragged_dot and the
    dense jnp reference too)."""
    got = fwd_bwd(f)(x, w, gs, dy)
    anchors = {"looped": looped(x, w, gs, dy)}
    if tiny:
        anchors["ragged_dot"] = fwd_bwd(ragged)(x, w, gs, dy)
        anchors["reference"] = fwd_bwd(grouped_matmul_reference)(x, w, gs, dy)
    ok = True
    for anchor, want in anchors.items():
        for name, g, r in zip(("y", "dx", "dw"), got, want):
            err = float(_rel_err(g, r))
            good = err < MAX_REL_ERR and g.shape == r.shape and g.dtype == r.dtype
            ok &= good
            emit(kind="check", shape=label, product=name, anchor=anchor, rel_err=err, ok=good)
            log(f"check {label} {name} vs {anchor}: rel err {err:.2e} {'ok' if good else 'FAILED'}")
    return ok


def timed_or_error(f, *args, iters):
    """Seconds per call, or the first line of the error (ragged_dot's gradient can run out of memory)."""
    try:
        return timeit(f, *args, iters=iters), None
    except Exception as e:  # noqa: BLE001 - reported in the table
        return float("nan"), (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def tune(label: str, candidates, make, args, iters: int):
    """The fastest candidate (its seconds) of make(candidate)(*args); a config that fails to compile is
    skipped. (None, inf) when all fail."""
    best, best_t = None, float("inf")
    for tiles in candidates:
        try:
            t = timeit(make(tiles), *args, iters=iters)
        except Exception as e:  # Triton cannot compile it (shared memory, layouts): skip
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log(f"tune {label} {tiles.label()}: FAILED {type(e).__name__}: {msg}")
            emit(kind="tune", product=label, tiles=tiles.label(), error=f"{type(e).__name__}: {msg}")
            continue
        log(f"tune {label} {tiles.label()}: {t * 1e3:.3f} ms")
        emit(kind="tune", product=label, tiles=tiles.label(), ms=t * 1e3)
        if t < best_t:
            best, best_t = tiles, t
    return best, best_t


def projections(shape: MoeShape):
    """(name, d_in, d_out, count per layer)."""
    return [("gate/up", shape.hidden, shape.ffn, 2), ("down", shape.ffn, shape.hidden, 1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check-only", action="store_true", help="only the numeric checks")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (runs on a CPU in interpret mode)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-tune", action="store_true", help="time the api's default tiles only")
    p.add_argument("--ragged-fwd-only", action="store_true",
                   help="time ragged_dot's forward only (its gradient asks for [A, E, O] buffers on the GPU)")
    args = p.parse_args(argv)
    interpret = None  # compiled on a GPU, interpret mode elsewhere
    shapes = TINY if args.tiny else SHAPES
    gmm_cands, tgmm_cands = (TINY_GMM, TINY_TGMM) if args.tiny else (GMM_CANDIDATES, TGMM_CANDIDATES)
    default_gmm, default_tgmm = (gmm_cands[0], tgmm_cands[0]) if args.tiny else (GMM_TILES, TGMM_TILES)
    log(f"backend {jax.default_backend()}, devices {jax.devices()}")

    cases = []  # (label, shape, name, count, (x, w, gs, dy))
    for i, shape in enumerate(shapes):
        key = jax.random.key(i)
        gs = router_group_sizes(shape, key)
        log(f"tokens {shape.tokens}: A = {shape.rows}, rows per expert min {int(gs.min())} "
            f"max {int(gs.max())} empty {int((gs == 0).sum())}")
        for name, d_in, d_out, count in projections(shape):
            x, w, dy = operands(shape, d_in, d_out, jax.random.fold_in(key, d_in))
            cases.append((f"T{shape.tokens} {name}", shape, name, count, (x, w, gs, dy)))

    ok = all([check(label, pallas(default_gmm, default_tgmm, interpret), *ops, tiny=args.tiny)
              for label, _, _, _, ops in cases])
    if not ok:
        log("numeric check FAILED: no timing")
        return 1
    if args.check_only:
        log("numeric checks passed")
        return 0

    gmm_tiles, tgmm_tiles = default_gmm, default_tgmm
    if not args.no_tune:
        x, w, gs, dy = cases[0][4]
        best, _ = tune("gmm", gmm_cands, lambda t: jax.jit(lambda x, w, gs: gmm(x, w, gs, tiles=t)), (x, w, gs),
                       args.iters)
        gmm_tiles = best or gmm_tiles
        best, _ = tune("tgmm", tgmm_cands, lambda t: jax.jit(lambda x, dy, gs: tgmm(x, dy, gs, tiles=t)),
                       (x, dy, gs), args.iters)
        tgmm_tiles = best or tgmm_tiles
        log(f"tiles: gmm {gmm_tiles.label()}, tgmm {tgmm_tiles.label()}")
        ok = all([check(label, pallas(gmm_tiles, tgmm_tiles, interpret), *ops, tiny=args.tiny)
                  for label, _, _, _, ops in cases])
        if not ok:
            log("numeric check of the tuned tiles FAILED: no timing")
            return 1

    paths = {"ragged_dot": ragged, "pallas": pallas(gmm_tiles, tgmm_tiles, interpret)}
    rows, layer = [], {}
    for label, shape, name, count, (x, w, gs, dy) in cases:
        flops = 2 * shape.rows * x.shape[1] * w.shape[2]
        for path, f in paths.items():
            t_f, err_f = timed_or_error(jax.jit(f), x, w, gs, iters=args.iters)
            if path == "ragged_dot" and args.ragged_fwd_only:
                t_fb, err_fb = float("nan"), "fwd+bwd not timed (--ragged-fwd-only)"
            else:
                t_fb, err_fb = timed_or_error(fwd_bwd(f), x, w, gs, dy, iters=args.iters)
            rec = dict(shape=label, path=path, fwd_ms=t_f * 1e3, fwd_bwd_ms=t_fb * 1e3,
                       fwd_tflops=flops / t_f / 1e12, fwd_bwd_tflops=3 * flops / t_fb / 1e12,
                       error=err_f or err_fb)
            emit(kind="time", **rec)
            log(f"{label} {path}: fwd {t_f * 1e3:.3f} ms, fwd+bwd {t_fb * 1e3:.3f} ms {rec['error'] or ''}")
            rows.append(rec)
            tot = layer.setdefault((shape.tokens, path), [0.0, 0.0])
            tot[0] += count * t_f * 1e3
            tot[1] += count * t_fb * 1e3

    print(f"\ngrouped matmul, {jax.devices()[0].device_kind}; pallas tiles gmm {gmm_tiles.label()}, "
          f"tgmm {tgmm_tiles.label()}")
    print(f"{'shape':<16} {'path':<11} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['shape']:<16} {r['path']:<11} {r['fwd_ms']:>9.3f} {r['fwd_tflops']:>8.1f} "
              f"{r['fwd_bwd_ms']:>11.3f} {r['fwd_bwd_tflops']:>8.1f}" + (f"  ({r['error']})" if r["error"] else ""))
    print("\nper MoE layer (gate + up + down):")
    for (tokens, path), (f_ms, fb_ms) in layer.items():
        base = layer[(tokens, "ragged_dot")]
        print(f"T{tokens:<15} {path:<11} fwd {f_ms:8.3f} ms ({base[0] / f_ms:5.2f}x ragged_dot speed)   "
              f"fwd+bwd {fb_ms:8.3f} ms ({base[1] / fb_ms:5.2f}x ragged_dot speed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
