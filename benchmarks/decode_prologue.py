"""The decode prologue (pallas_kernels/decode_prologue) against XLA's ops, in one GPU call (< 5 min).

    python benchmarks/decode_prologue.py            # GPU: check + time at Qwen3-0.6B / 8B shapes, 1 and 8 rows
    python benchmarks/decode_prologue.py --smoke    # CPU: tiny shapes, interpret mode, the check only

Each variant is first checked against the jnp reference (bf16: the same numbers; the pools' written slots and nothing
else), then timed as L back-to-back layers in one jitted layer loop (a fori_loop over the layer index with the
pools carried and donated, as the decoder carries the serving pool): per layer, `xla` runs reference.py's ops
(the split, the two norms, rope and the scatter into the pool, which XLA fuses as it can) and `pallas` the kernel.
Columns: us per layer of each and their ratio. The engine A/B (what the setting changes per token):

    SUROJAX_DECODE_PROLOGUE=pallas python3 benchmarks/serve_load.py --shape qwen3-0.6b --modes engine --users 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qwen3-0.6b": (16, 8, 128, 28), "qwen3-8b": (32, 8, 128, 36)}  # N, K, H, layers
SMOKE = {"debug": (4, 2, 16, 2)}


def run(name, n, k, h, layers, m, slots_total, smoke):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.decode_prologue import decode_prologue, decode_prologue_ref

    dt = jnp.bfloat16
    rng = np.random.default_rng(0)
    a = lambda *s: jnp.asarray(rng.standard_normal(s), dt)  # noqa: E731
    qkv, cos, sin = a(m, (n + 2 * k) * h), a(m, h), a(m, h)
    qw, kw = a(h) * 0.1 + 1, a(h) * 0.1 + 1
    slots = jnp.asarray(rng.choice(slots_total, m, replace=False), jnp.int32).at[-1].set(slots_total if m > 1 else 0)
    # the pools drawn on the device: numpy's float64 normals of 28 x 65,536 x 8 x 128 took most of a minute each
    # (session 27's GPU call timed out after the first row)
    kp, vp = (jax.random.normal(jax.random.key(i), (layers, slots_total, k, h), dt) for i in (1, 2))
    kw_ = dict(q_norm_weight=qw, k_norm_weight=kw)
    got = decode_prologue(qkv, cos, sin, kp, vp, 1, slots, num_heads=n, norm="plain", **kw_)
    want = decode_prologue_ref(qkv, cos, sin, kp, vp, 1, slots, num_heads=n, num_kv_heads=k, **kw_)
    ok = all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want))
    if smoke:
        print(f"{name} m{m}: {'OK' if ok else 'MISMATCH'}")
        return ok

    def loop(fn):
        # each layer's qkv differs (a loop-invariant qkv let XLA hoist its q ops out of the loop) and all of q is
        # consumed (only q[0, 0, 0] left the other heads' ops dead): else the XLA side times the pool write alone
        # (session 26's run: "13.5 vs 5.4 us", while the engine gained 3-9% from the kernel)
        def body(l, carry):
            kp, vp, acc = carry
            q, kp, vp = fn(qkv + l.astype(qkv.dtype), cos, sin, kp, vp, l, slots)
            return kp, vp, acc + q.astype(jnp.float32).sum()
        return jax.jit(lambda kp, vp: jax.lax.fori_loop(0, layers, body, (kp, vp, jnp.float32(0))),
                       donate_argnums=(0, 1))

    xla = loop(lambda *x: decode_prologue_ref(*x, num_heads=n, num_kv_heads=k, **kw_))
    pallas = loop(lambda *x: decode_prologue(*x, num_heads=n, norm="plain", **kw_))
    times = {}
    for label, fn in (("xla", xla), ("pallas", pallas)):
        kp, vp, _ = jax.block_until_ready(fn(kp, vp))  # compile
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50):
                kp, vp, s = fn(kp, vp)
            jax.block_until_ready(s)
            best = min(best, (time.perf_counter() - t) / 50 / layers * 1e6)
        times[label] = best
    print(f"{name:12s} m{m}  check {'OK' if ok else 'MISMATCH'}  xla {times['xla']:6.2f} us/layer  "
          f"pallas {times['pallas']:6.2f} us/layer  xla/pallas {times['xla'] / times['pallas']:.2f}", flush=True)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    shapes = SMOKE if args.smoke else SHAPES
    ok = True
    for name, (n, k, h, layers) in shapes.items():
        for m in (1, 8):
            ok &= run(name, n, k, h, layers, m, 64 if args.smoke else 4096 * 16, args.smoke)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
