"""The decode GEMV (pallas_kernels/decode_gemv) against XLA, per linear and per decode step, in one GPU call (< 5 min).

    python benchmarks/decode_gemv.py            # GPU: per-linear sweep + the engine A/B at one user
    python benchmarks/decode_gemv.py --smoke    # CPU: tiny shapes, interpret mode, the engine A/B on `debug`
    python benchmarks/decode_gemv.py --no-engine   # the per-linear part only
    python benchmarks/decode_gemv.py --shapes qwen3-0.6b --engine-users 1,16   # also 16 users
    python benchmarks/decode_gemv.py --shapes qwen3-8b --rows 1,8,16,64 --no-engine   # the dot body's A/B
    python benchmarks/decode_gemv.py --no-per-linear --engine-shape qwen3-8b --engine-users 16,64   # engine only

Part 1, per linear: the Qwen3-0.6B and Qwen3-8B decode linears as the server holds them (q/k/v and gate/up joined:
fused_projections), bf16, at M = 1, 2, 4, 8, 16, 32, 64 rows (--rows). Each variant is first checked against the
jnp reference (pallas_kernels/decode_gemv/reference.py; bf16 tolerance as tests/pallas_kernels/test_decode_gemv.py),
then timed
as L back-to-back applications in one jitted, unrolled layer loop over a stack of L distinct weights (L such that
the stack is >= 3x an H100's 50 MB L2: every weight comes from HBM, as in a decode step; a Python loop around one
~5 us kernel would time the dispatch instead). Columns:

    xla          einsum over the [K, N] kernel, the layer a static slice (XLA's multiply + reduce fusions at few
                 rows, cuBLAS at more)
    xla_t        (M > 8) einsum over the [N, K] stack, the layer a dynamic index: what GemvWeight.matmul runs above
                 the kernel's rows today, inside the decoder's layer scan (XLA copies the layer out of the stack
                 before the GEMM unless it fuses the slice into it)
    pallas       (M <= 8) the kernel's FMA body on the [N, K] stack in place, the best of CANDIDATES tiles at M = 1
                 (that tile at every M)
    dot          the kernel's tensor-core body (GemvTiles.dot), the best of DOT_CANDIDATES at each of SWEEP_ROWS
                 present (M = 1, 16, 64: a row between takes the tiles of the sweep row below it)
    xla+fused / pallas+fused / dot+fused   the linear with what the kernel fuses around it in the decoder: qkv with
                 the attention RMSNorm, o with the residual add, gate/up with the MLP RMSNorm and silu(g) * u, down
                 with the residual (XLA: the same ops as separate jnp, which it fuses as it can)
    pallas_GB/s, dot_GB/s   weight bytes / the pallas (dot) time
    pallas_tiles, dot_tiles the sweeps' winners (copy them into pallas_kernels/decode_gemv/api.py TUNED_TILES,
                 keyed (N_out, K), and TUNED_DOT_TILES, keyed (N_out, K, M_pad))

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
    Above 8 rows (the dot body): still bound by the weight's bytes up to 64 rows (an H100 does ~1,000 TFLOP/s of
                bf16 against 3 TB/s: ~330 flops a weight byte, 64 rows use 64), so the dot time should stay near
                the M = 1 time; xla_t pays a copy of the layer (read + write) before cuBLAS's read, ~3x the bytes.
                The dot body at M <= 8 (16 padded rows) against the FMA body: equal or faster if Triton's pipelined
                loads (num_stages) stream the weight faster than the FMA body's plain loads (~1.7 TB/s at one row).
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


def _dot_candidates():
    """The tensor-core body: bn (x is re-read per program: M_pad / bn times the weight's bytes from L2, against
    the programs a grid has), bk (the weight tile [bn, bk] and x tile [M_pad, bk] per stage), num_stages (the
    pipelined loads' buffers: the reason a dot may stream faster than the FMA body's plain loads)."""
    from pallas_kernels.decode_gemv.kernel import GemvTiles

    return [GemvTiles(bn, bk, w, s, dot=True) for bn, bk, w, s in
            ((16, 128, 4, 3), (16, 256, 4, 3), (16, 128, 4, 5), (16, 512, 4, 3), (32, 128, 4, 3), (32, 128, 4, 5),
             (32, 256, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (64, 128, 8, 3))]


CANDIDATES = _candidates()
DOT_CANDIDATES = _dot_candidates()
ROWS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_ROWS = (1, 16, 64)  # the dot body's tiles are swept at these rows (the FMA body's at the first row)
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


def _xla_t():
    """einsum over the [N, K] stack at a traced layer index, L times (GemvWeight.matmul's XLA path in the scan)."""
    import jax
    import jax.numpy as jnp

    def run(x, wt, idx):
        return tuple(jnp.einsum("mk,nk->mn", x, jax.lax.dynamic_index_in_dim(wt, idx[i], 0, keepdims=False))
                     for i in range(wt.shape[0]))

    return jax.jit(run)


def _time(f, *args, iters: int) -> float:
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import timeit

    jax.block_until_ready(f(*args))
    return timeit(f, *args, iters=iters)


def _sweep(lin, m, tried, fused, interpret, x, wt, w, nw, r, layers, iters, label) -> dict:
    """{tiles: seconds a layer} of the tiles that pass the check (layer 1 through the kernel against the reference:
    XLA's own ops) and compile."""
    import numpy as np

    times = {}
    for t in tried:
        fp, _, one_p, one_x = _fns(lin, t, fused, interpret)
        try:
            got = np.asarray(one_p(x, wt, 1, nw, r), np.float32)
            want = np.asarray(one_x(x, w[1], nw, r), np.float32)
            scale = float(np.max(np.abs(want)))
            if not np.all(np.abs(got - want) <= 2 ** -6 * (np.abs(want) + scale)):
                print(f"CHECK FAILED {label} M={m} fused={fused} {t.label()}: max diff "
                      f"{float(np.max(np.abs(got - want)))} at scale {scale}", flush=True)
                continue
            times[t] = _time(fp, x, wt, nw, r, iters=iters) / layers
        except Exception as e:  # noqa: BLE001 - a tile that fails to compile: report, go on
            print(f"FAILED {label} M={m} {t.label()}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    return times


def per_linear(a) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.decode_gemv.api import dot_tiles_for, on_gpu, tiles_for
    from pallas_kernels.decode_gemv.kernel import MAX_ROWS, fit

    interpret = not on_gpu()
    dtype = jnp.bfloat16
    shapes = SMOKE_SHAPES if a.smoke else {k: v for k, v in SHAPES.items() if k in a.shapes.split(",")}
    rows = tuple(int(v) for v in a.rows.split(",")) if a.rows else ((1, 3, 16) if a.smoke else ROWS)
    bodies = {"pallas": CANDIDATES[:2] if a.smoke else CANDIDATES,   # column prefix: the tiles it sweeps
              "dot": DOT_CANDIDATES[:2] if a.smoke else DOT_CANDIDATES}
    bodies = {b: c for b, c in bodies.items() if b in a.bodies.split(",")}
    results = []
    t_start = time.perf_counter()
    for model, linears in shapes.items():
        for lin in linears:
            nbytes = lin.n * lin.k * 2
            layers = 2 if a.smoke else max(4, math.ceil(3 * L2_BYTES / nbytes))
            n_out = lin.n // 2 if lin.gated else lin.n
            best = {}  # body -> the tiles its last sweep chose
            for m in rows:
                x, wt, nw, r = _operands(lin, m, layers, dtype, jax.random.key(m))
                w = jnp.swapaxes(wt, 1, 2)            # the [K, N] kernels XLA reads
                iters = 1 if a.smoke else 20
                row = {"model": model, "linear": lin.name, "N": lin.n, "K": lin.k, "M": m, "layers": layers}
                for body, cands in bodies.items():
                    if body == "pallas" and m > MAX_ROWS:
                        continue
                    default = dot_tiles_for(n_out, lin.k, m) if body == "dot" else tiles_for(n_out, lin.k)
                    sweep = body not in best or (body == "dot" and m in SWEEP_ROWS)
                    for fused in (False, True):
                        if sweep and not fused:
                            past = time.perf_counter() - t_start > a.sweep_budget_s  # past it: the default only
                            tried = [default] if past else list(dict.fromkeys([default, *cands]))
                        else:
                            tried = [best[body]]
                        times = _sweep(lin, m, [fit(t, n_out, lin.k) for t in tried], fused, interpret, x, wt, w,
                                       nw, r, layers, iters, f"{model} {lin.name}")
                        if not times:
                            continue
                        t_best = min(times, key=times.get)
                        if not fused:
                            best[body] = t_best
                            row[f"{body}_tiles"] = t_best.label()
                            row[f"{body}_GB/s"] = nbytes / times[t_best] / 1e9
                        row[body + ("+fused" if fused else "") + "_us"] = 1e6 * times[t_best]
                for fused in (False, True):
                    fx = _fns(lin, None, fused, interpret)[1]
                    row["xla" + ("+fused" if fused else "") + "_us"] = \
                        1e6 * _time(fx, x, w, nw, r, iters=iters) / layers
                if m > MAX_ROWS:
                    row["xla_t_us"] = 1e6 * _time(_xla_t(), x, wt, jnp.arange(layers), iters=iters) / layers
                print("RESULT " + json.dumps(row), flush=True)
                results.append(row)
    return results


def engine_ab(a) -> list[dict]:
    """serve_load.py --modes engine at --engine-users under SUROJAX_DECODE_GEMV=xla and =pallas (own processes)."""
    script = str(Path(__file__).resolve().parent / "serve_load.py")
    args = ["--smoke"] if a.smoke else ["--shape", a.engine_shape, "--prompt-len", "128", "--max-tokens", "128"]
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
    cols = ["model", "linear", "N", "K", "M", "xla_us", "xla_t_us", "pallas_us", "dot_us", "xla+fused_us",
            "pallas+fused_us", "dot+fused_us", "pallas_GB/s", "dot_GB/s", "pallas_tiles", "dot_tiles"]
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
    p.add_argument("--rows", default=None, help="comma list of M (default 1,2,4,8,16,32,64; --smoke 1,3,16)")
    p.add_argument("--bodies", default="pallas,dot", help="the kernel bodies to time: pallas (FMA, M <= 8), dot")
    p.add_argument("--no-per-linear", action="store_true", help="skip the per-linear part")
    p.add_argument("--no-engine", action="store_true", help="skip the engine A/B")
    p.add_argument("--engine-shape", default="qwen3-0.6b", help="serve_load.py --shape of the engine A/B")
    p.add_argument("--sweep-budget-s", type=float, default=150.0,
                   help="seconds of the per-linear part after which a linear's tile sweep is skipped (the default "
                        "tiles only), so that one GPU call stays under ~5 minutes")
    p.add_argument("--engine-users", default="1",
                   help="users of the engine A/B (comma list; e.g. 1,16,64: above 8 rows pallas takes the kernel's "
                        "dot body, xla XLA's einsum on the [K, N] kernels)")
    a = p.parse_args(argv)
    import jax

    print(f"# device {jax.devices()[0].device_kind}", flush=True)
    lin_rows = [] if a.no_per_linear else per_linear(a)
    eng_rows = [] if a.no_engine else engine_ab(a)
    table(lin_rows, eng_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
