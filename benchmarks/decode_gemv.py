"""The decode GEMV (pallas_kernels/decode_gemv) against XLA, per linear and per decode step, in one GPU call (< 5 min).

    python benchmarks/decode_gemv.py            # GPU: per-linear sweep + the engine A/B at one user
    python benchmarks/decode_gemv.py --smoke    # CPU: tiny shapes, interpret mode, the engine A/B on `debug`
    python benchmarks/decode_gemv.py --no-engine   # the per-linear part only
    python benchmarks/decode_gemv.py --shapes qwen3-0.6b --engine-users 1,16   # also 16 users (XLA on [N, K])

Part 1, per linear: the Qwen3-0.6B and Qwen3-8B decode linears as the server holds them (q/k/v and gate/up joined:
fused_projections), bf16, at M = 1, 2, 4, 8 rows. Each variant is first checked against the jnp reference
(pallas_kernels/decode_gemv/reference.py; bf16 tolerance as tests/pallas_kernels/test_decode_gemv.py), then timed
as L back-to-back applications in one jitted, unrolled layer loop over a stack of L distinct weights (L such that
the stack is >= 3x an H100's 50 MB L2: every weight comes from HBM, as in a decode step; a Python loop around one
~5 us kernel would time the dispatch instead). Columns:

    xla          einsum over the [K, N] kernel (what the decoder runs today: XLA's multiply + reduce fusions)
    pallas       the kernel on the [N, K] weight, the best of CANDIDATES tiles at M = 1 (that tile at every M)
    xla+fused / pallas+fused   the linear with what the kernel fuses around it in the decoder: qkv with the
                 attention RMSNorm, o with the residual add, gate_up with the MLP RMSNorm and silu(g) * u, down
                 with the residual (XLA: the same ops as separate jnp, which it fuses as it can)
    GB/s         weight bytes / the pallas time
    best tiles   the sweep's winner (copy it into pallas_kernels/decode_gemv/api.py TUNED_TILES)

Part 2, the decode step: benchmarks/serve_load.py --modes engine at one user (Qwen3-0.6B shape, random bf16 weights,
prompt 128, 128 new tokens) twice, SUROJAX_DECODE_GEMV=xla and =pallas, each in its own process; its decode tok/s.
(Under pallas the decode step runs each layer's four linears as four kernels with the two RMSNorms, silu(g) * u and
the two residual adds fused: the pallas+fused column's forms.)

Expected on an H100 (~3 TB/s HBM read, ~3 us a launch; per linear: bytes / 3 TB/s + the launch):
    Qwen3-0.6B  qkv [4096 x 1024] 8.4 MB -> ~2.8 + 3 us;  o [1024 x 2048] 4.2 MB -> ~1.4 + 3 us;
                gate_up [6144 x 1024] 12.6 MB -> ~4.2 + 3 us;  down [1024 x 3072] 6.3 MB -> ~2.1 + 3 us
                a layer's four GEMVs ~22 us at best vs XLA's ~0.6 TB/s (~53 us of reads plus 8 launches); per
                token 28 layers: the GEMVs alone from ~1.7 ms towards ~0.6 ms. The pallas time should be within
                ~1.5x of bytes / 3 TB/s + 3 us at M = 1, and grow little up to M = 8 (the weight is read once).
    Qwen3-8B    qkv 50 MB ~17 us, o 34 MB ~11 us, gate_up 201 MB ~67 us, down 101 MB ~34 us: bandwidth-bound,
                the kernel's GB/s should approach ~2.5-3 TB/s; XLA's two-fusion GEMV at ~0.6-1.5 TB/s.
    Engine tok/s at one user: pallas above xla by the GEMV time saved per token plus ~5 small fusions a layer
    (2 norms, the activation, 2 residual adds: ~28 x 5 x ~1.3 us); rope, the q / k norms and the KV write stay XLA
    fusions. From ~400 tok/s (2.47 ms a token, docs/serving.md) towards ~600-700 if the GEMVs reach ~2.5 TB/s.
A table prints last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclasses.dataclass(frozen=True)
class Linear:
    name: str
    n: int            # output rows of the transposed weight (2F for a joined gate/up)
    k: int
    gated: bool = False
    norm: bool = False
    residual: bool = False


def _layer(d: int, q: int, kv: int, f: int) -> list[Linear]:
    return [Linear("qkv", q + 2 * kv, d, norm=True), Linear("o", d, q, residual=True),
            Linear("gate_up", 2 * f, d, gated=True, norm=True), Linear("down", d, f, residual=True)]


SHAPES = {"qwen3-0.6b": _layer(1024, 2048, 1024, 3072), "qwen3-8b": _layer(4096, 4096, 1024, 12288)}
SMOKE_SHAPES = {"debug": _layer(64, 64, 32, 128)}


def _candidates():
    from pallas_kernels.decode_gemv.kernel import GemvTiles

    return [GemvTiles(bn, bk, w, s, d) for bn, bk, w, s, d in
            ((4, 1024, 4, 3, False), (8, 512, 4, 3, False), (16, 256, 4, 3, False), (16, 512, 8, 3, False),
             (64, 128, 8, 3, False),   # the sum over bk every step; below: summed once after the loop
             (4, 512, 4, 3, True), (8, 256, 4, 3, True), (16, 256, 8, 3, True), (32, 128, 8, 3, True))]


CANDIDATES = _candidates()
ROWS = (1, 2, 4, 8)
L2_BYTES = 50 * 2 ** 20


def _operands(lin: Linear, m: int, layers: int, dtype, key):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(key, 4)
    w = (jax.random.normal(ks[0], (layers, lin.n, lin.k), jnp.float32) * lin.k ** -0.5).astype(dtype)
    x = jax.random.normal(ks[1], (m, lin.k), jnp.float32).astype(dtype)
    nw = (1 + 0.1 * jax.random.normal(ks[2], (lin.k,), jnp.float32)).astype(dtype)
    r = jax.random.normal(ks[3], (m, lin.n // 2 if lin.gated else lin.n), jnp.float32).astype(dtype)
    return x, w, nw, r


def _fns(lin: Linear, tiles, fused: bool, interpret: bool):
    """(pallas(x, w_t stack, nw, r), xla(x, w [L, K, N] stack, nw, r)): the L layers back to back, each output the
    next layer's carry (the residual variants add it; the others overwrite it), every output returned."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.decode_gemv.api import decode_gemv
    from pallas_kernels.decode_gemv.reference import ACTIVATIONS, rms_norm_ref

    norm = "plain" if fused and lin.norm else None
    act = "silu" if lin.gated and fused else None
    res = fused and lin.residual

    def one_pallas(x, wt, i, nw, r):
        return decode_gemv(x, wt, layer=i, tiles=tiles, interpret=interpret, norm_weight=nw if norm else None,
                           norm=norm, activation=act, residual=r if res else None)

    def one_xla(x, w, nw, r):
        if norm:
            x = rms_norm_ref(x, nw, 1e-6, False)
        y = jnp.einsum("mk,kn->mn", x, w)
        if act:
            g, u = jnp.split(y, 2, axis=-1)
            y = ACTIVATIONS[act](g) * u
        return y + r if res else y

    # Every layer's output is returned: a variant whose output only overwrites the carry (no residual) would
    # otherwise leave all but the last application dead, and XLA drops dead code, custom calls included (session
    # 23's first GPU run timed one application over L and printed 10 TB/s).
    def pallas(x, wt, nw, r):
        outs = []
        for i in range(wt.shape[0]):
            r = one_pallas(x, wt, i, nw, r)
            outs.append(r)
        return tuple(outs)

    def xla(x, w, nw, r):
        outs = []
        for i in range(w.shape[0]):
            r = one_xla(x, w[i], nw, r)
            outs.append(r)
        return tuple(outs)

    return jax.jit(pallas), jax.jit(xla), one_pallas, one_xla


def _time(f, *args, iters: int) -> float:
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import timeit

    jax.block_until_ready(f(*args))
    return timeit(f, *args, iters=iters)


def per_linear(a) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode_gemv.api import on_gpu, tiles_for
    from pallas_kernels.decode_gemv.kernel import fit

    interpret = not on_gpu()
    dtype = jnp.bfloat16
    shapes = SMOKE_SHAPES if a.smoke else {k: v for k, v in SHAPES.items() if k in a.shapes.split(",")}
    rows = (1, 3) if a.smoke else ROWS
    cands = CANDIDATES[:2] if a.smoke else CANDIDATES
    results = []
    t_start = time.perf_counter()
    for model, linears in shapes.items():
        for lin in linears:
            nbytes = lin.n * lin.k * 2
            layers = 2 if a.smoke else max(4, math.ceil(3 * L2_BYTES / nbytes))
            n_out = lin.n // 2 if lin.gated else lin.n
            best = None
            for m in rows:
                x, wt, nw, r = _operands(lin, m, layers, dtype, jax.random.key(m))
                w = jnp.swapaxes(wt, 1, 2)            # the [K, N] kernels XLA reads
                iters = 1 if a.smoke else 20
                row = {"model": model, "linear": lin.name, "N": lin.n, "K": lin.k, "M": m, "layers": layers}
                for fused in (False, True):
                    tried = cands if m == rows[0] and not fused else [best]  # the sweep: M = 1, the plain GEMV
                    if best is None and time.perf_counter() - t_start > a.sweep_budget_s:  # past it: defaults only
                        tried = [tiles_for(n_out, lin.k)]
                    times = {}
                    for tiles in tried:
                        t = fit(tiles, n_out, lin.k)
                        fp, fx, one_p, one_x = _fns(lin, t, fused, interpret)
                        try:  # the check: layer 1 through the kernel against the reference (XLA's own ops)
                            got = np.asarray(one_p(x, wt, 1, nw, r), np.float32)
                            want = np.asarray(one_x(x, w[1], nw, r), np.float32)
                            scale = float(np.max(np.abs(want)))
                            ok = bool(np.all(np.abs(got - want) <= 2 ** -6 * (np.abs(want) + scale)))
                            if not ok:
                                print(f"CHECK FAILED {model} {lin.name} M={m} fused={fused} {t.label()}: max diff "
                                      f"{float(np.max(np.abs(got - want)))} at scale {scale}", flush=True)
                                continue
                            times[t] = _time(fp, x, wt, nw, r, iters=iters) / layers
                        except Exception as e:  # noqa: BLE001 - a tile that fails to compile: report, go on
                            print(f"FAILED {model} {lin.name} M={m} {t.label()}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:300]}", flush=True)
                    if not times:
                        continue
                    t_best = min(times, key=times.get)
                    best = best or t_best
                    key = "pallas+fused" if fused else "pallas"
                    row[key + "_us"] = 1e6 * times[t_best]
                    row[key.replace("pallas", "xla") + "_us"] = 1e6 * _time(fx, x, w, nw, r, iters=iters) / layers
                    if not fused:
                        row["tiles"] = t_best.label()
                        row["GB/s"] = nbytes / times[t_best] / 1e9
                print("RESULT " + json.dumps(row), flush=True)
                results.append(row)
    return results


def engine_ab(a) -> list[dict]:
    """serve_load.py --modes engine at one user under SUROJAX_DECODE_GEMV=xla and =pallas (own processes)."""
    script = str(Path(__file__).resolve().parent / "serve_load.py")
    args = ["--smoke"] if a.smoke else ["--shape", "qwen3-0.6b", "--prompt-len", "128", "--max-tokens", "128"]
    out = []
    for mode in ("xla", "pallas"):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, script, "--modes", "engine", "--users", a.engine_users, "--rounds", "1",
                            "--child",
                            *args], capture_output=True, text=True, env={**os.environ, "SUROJAX_DECODE_GEMV": mode})
        for ln in p.stdout.splitlines():
            if ln.startswith("RESULT ") or ln.startswith("# model"):
                print(ln, flush=True)
        if p.returncode:
            print(f"# engine under SUROJAX_DECODE_GEMV={mode} failed ({p.returncode}):\n{p.stderr[-3000:]}",
                  flush=True)
            continue
        for ln in p.stdout.splitlines():
            if ln.startswith("RESULT "):
                r = json.loads(ln[7:])
                out.append({"decode_gemv": mode, "users": r["users"], "decode_tok_s": r["decode_tok_s"],
                            "itl_p50_ms": r["itl_p50_ms"],
                            "wall_s": time.perf_counter() - t0})
    return out


def table(lin_rows: list[dict], eng_rows: list[dict]) -> None:
    cols = ["model", "linear", "N", "K", "M", "xla_us", "pallas_us", "xla+fused_us", "pallas+fused_us", "GB/s", "tiles"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in lin_rows:
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        print("| " + " | ".join(cells) + " |")
    if eng_rows:
        print("\n| engine | users | decode tok/s | ITL p50 ms |\n|---|---|---|---|")
        for r in eng_rows:
            print(f"| SUROJAX_DECODE_GEMV={r['decode_gemv']} | {r['users']} | {r['decode_tok_s']:.1f} | "
                  f"{r['itl_p50_ms']:.2f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, interpret mode")
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--no-engine", action="store_true", help="skip the engine A/B")
    p.add_argument("--sweep-budget-s", type=float, default=150.0,
                   help="seconds of the per-linear part after which a linear's tile sweep is skipped (the default "
                        "tiles only), so that one GPU call stays under ~5 minutes")
    p.add_argument("--engine-users", default="1",
                   help="users of the engine A/B (comma list; e.g. 1,16: above 8 rows the transposed weights go "
                        "through XLA's einsum, which must not be slower than the [K, N] path)")
    a = p.parse_args(argv)
    import jax

    print(f"# device {jax.devices()[0].device_kind}", flush=True)
    lin_rows = per_linear(a)
    eng_rows = [] if a.no_engine else engine_ab(a)
    table(lin_rows, eng_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
