"""MoE decode: the gathered expert form against the grouped GEMM (surojax/models/layers/moe.py, issue 39 item 2).

    python benchmarks/moe_decode.py                                 # GPU: qwen3-30b-a3b, rows 1..32, bf16 + q4_k
    python benchmarks/moe_decode.py --smoke                         # CPU: debug-moe, tiny lengths
    python benchmarks/moe_decode.py --no-engine --rows 1,8,16,32,64 # the layer timings alone (the crossover)
    python benchmarks/moe_decode.py --quant '' --paths gather,gather_pallas --gather-tiles '128,64,8;64,64,4'
                                                                    # the gathered GEMV kernel's tiles, bf16

Two measurements, each under every path of --paths (the kernel setting SUROJAX_MOE_DECODE = gather / grouped;
`auto` picks the gather while rows x k <= E x GATHER_CROSSOVER; `gather_pallas` = the gather with
SUROJAX_MOE_GATHER_KERNEL=pallas: the gathered GEMV kernel reads each routed expert in place, no gathered copy.
Off a GPU the kernel setting is ignored, so there gather_pallas times the XLA gather again (--smoke checks that
the path runs, not the kernel). With a --quant format gather_pallas is an engine row only (the server lays the
quantised expert stacks out for the gathered quantised GEMV; benchmarks/gathered_qgemv.py times that kernel):

  layer   --layers MoE layers of the shape (random weights, --dtype or a --quant expert format: random codes),
          applied in sequence (x += moe(x)) to R rows, one jitted call; µs per layer for each R in --rows. The
          layers' experts together exceed the L2 cache, so each call reads its experts from HBM. With each row the
          expected bytes per layer: gather = R x k experts' bytes (an expert routed twice read twice), grouped = all
          E experts' bytes, and the HBM rate they imply.
  engine  one user through the serving engine (`benchmarks/serve_load.py --modes engine --users 1`, the whole
          model of --shape, --prompt-len / --max-tokens; with a --quant format serve_load's random base: the
          attention projections and the experts in it), one child process per path (the setting is read at trace
          time): decode tok/s. Issue 39's target: >= 200 tok/s at one user on qwen3-30b-a3b.

What it should move: one decode token on Qwen3-30B-A3B shapes reads all 128 experts' weights of each layer on the
grouped path (48 x 128 x 3 x 2048 x 768 x 2 bytes = 58 GB in bf16: 41 ms a token measured, session 4) and 8 of
them on the gathered one (3.6 GB: ~16x fewer bytes; ~1.2 ms at 3 TB/s, ~3.6 ms if XLA writes the gathered copy
before the products read it), so the routed experts stop being the decode step's cost. Prints `RESULT {...}` lines
and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PATHS = ("gather", "grouped", "gather_pallas")
# path -> (SUROJAX_MOE_DECODE, SUROJAX_MOE_GATHER_KERNEL) in the layer timing; the engine runs `gather` as auto
SETTINGS = {"gather": ("gather", "xla"), "grouped": ("grouped", "xla"), "gather_pallas": ("gather", "pallas")}


def expert_bytes(cfg, fmt: str | None, dtype) -> float:
    """Bytes of one expert's gate_up [D, 2F] and down [F, D] weights in the benchmark's storage."""
    import numpy as np

    from surojax.quant import FORMATS

    values = 3 * cfg.hidden_size * cfg.moe.expert_intermediate_size
    return values * (FORMATS[fmt].bytes_per_value() if fmt else np.dtype(dtype).itemsize)


def build_layers(cfg, n: int, dtype, fmt: str | None):
    """n MoE layers of cfg's shape, weights random in dtype (experts in `fmt`, random codes, if given)."""
    import jax
    from flax import nnx

    from surojax.models.layers.moe import MoE
    from surojax.quant.random_weights import random_weight
    from surojax.quant.transform import QuantParam

    layers = []
    for i in range(n):
        m = MoE(cfg.hidden_size, cfg.moe, param_dtype=dtype, rngs=nnx.Rngs(i))
        if fmt:
            for j, lin in enumerate((m.experts.gate_up_proj, m.experts.down_proj)):
                E, k, out = lin.kernel.get_value().shape
                q = random_weight(fmt, k, out, jax.random.key(100 * i + j), (E,))
                lin.kernel = QuantParam(q, **lin.kernel.get_metadata())
        layers.append(m)
    return layers


def layer_rows(a, cfg, fmt: str | None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import pallas_kernels.gathered_gemv.api as gathered_api
    from surojax.kernel_settings import use_kernel_settings
    from timing import timeit

    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    layers = build_layers(cfg, a.layers, dtype, fmt)
    graphdef, state = nnx.split(layers)
    E, k = cfg.moe.num_experts, cfg.moe.experts_per_token
    per_expert = expert_bytes(cfg, fmt, dtype)
    out = []
    for R in a.rows_list:
        x = jax.random.normal(jax.random.key(R), (R, 1, cfg.hidden_size), dtype)
        seg = jnp.ones((R, 1), jnp.int32)
        # the kernel once per --gather-tiles entry (None: its default tiles)
        variants = [(p, t) for p in a.paths for t in (a.gather_tiles if p == "gather_pallas" else [None])
                    if not (fmt and p == "gather_pallas")]  # layer rows: the plain kernel only
        for path, tiles in variants:
            def run(state, x):
                for m in nnx.merge(graphdef, state):
                    x = x + m(x, seg)[0]
                return x

            decode, gather_kernel = SETTINGS[path]
            default_tiles = gathered_api.TILES
            # a fresh jit per variant: the settings and the kernel's tiles are read at trace time
            with use_kernel_settings(moe_decode=decode, moe_gather_kernel=gather_kernel):
                gathered_api.TILES = tiles or default_tiles
                try:
                    fn = jax.jit(run)
                    sec = timeit(fn, state, x, iters=a.iters)
                finally:
                    gathered_api.TILES = default_tiles
            us = sec / a.layers * 1e6
            nbytes = (E if path == "grouped" else R * k) * per_expert
            label = f"{path}[{tiles.label()}]" if tiles else path
            r = dict(kind="layer", shape=a.shape, experts=fmt or a.dtype, rows=R, path=label, us_per_layer=us,
                     mb_per_layer=nbytes / 1e6, tb_per_s=nbytes / (us * 1e-6) / 1e12,
                     ms_per_token_all_layers=us * cfg.num_layers / 1e3,
                     device=jax.devices()[0].device_kind)
            print("RESULT " + json.dumps(r), flush=True)
            out.append(r)
    return out


def engine_rows(a) -> list[dict]:
    """serve_load's engine mode at one user, once per path (a child process each; `gather` runs as auto)."""
    out = []
    for fmt in a.formats:
        for path in a.paths:  # gather_pallas with a --quant format: the quantised experts laid out for its kernel
            cmd = [sys.executable, str(ROOT / "benchmarks/serve_load.py"), "--modes", "engine", "--users", "1",
                   "--rounds", "1", "--shape", a.shape, "--dtype", a.dtype, "--prompt-len", str(a.prompt_len),
                   "--max-tokens", str(a.max_tokens)] + (["--quant", fmt] if fmt else [])
            # the gathered path through `auto`: it gathers the decode calls' few rows and keeps the grouped GEMM for
            # the prefill (forced `gather` there gathers 128 rows x 8 experts' weights, ~10 GB a layer in bf16 at
            # Qwen3-30B-A3B shapes: the engine ran out of memory that way on an H100, session 26)
            decode, gather_kernel = SETTINGS[path]
            env = {**os.environ, "SUROJAX_MOE_DECODE": "auto" if decode == "gather" else decode,
                   "SUROJAX_MOE_GATHER_KERNEL": gather_kernel}
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            got = [json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not got:
                print(f"# engine {path} {fmt or a.dtype} failed (exit {p.returncode}): {p.stderr[-2000:]}", flush=True)
                continue
            r = dict(kind="engine", shape=a.shape, experts=fmt or a.dtype, rows=1, path=path,
                     decode_tok_s=got[-1]["decode_tok_s"], itl_p50_ms=got[-1]["itl_p50_ms"])
            print("RESULT " + json.dumps(r), flush=True)
            out.append(r)
    return out


def table(results: list[dict]) -> str:
    cols = ["kind", "experts", "rows", "path", "us_per_layer", "mb_per_layer", "tb_per_s", "ms_per_token_all_layers",
            "decode_tok_s", "itl_p50_ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                       for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", help="a MoE shape of surojax.bench.shapes")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quant", default="q4_k", help="comma list of expert formats (random codes) timed besides "
                                                   "--dtype; '' for none")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="comma list of decode rows R (layer timing)")
    p.add_argument("--layers", type=int, default=8, help="MoE layers per timed call (past the L2 cache)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-engine", action="store_true", help="the layer timings alone")
    p.add_argument("--paths", default=",".join(PATHS), help="comma list of the paths timed (gather, grouped, "
                                                               "gather_pallas)")
    p.add_argument("--gather-tiles", default="", help="gather_pallas's layer timing once per tile configuration, "
                   "';'-separated bi,bo,num_warps (e.g. '128,64,8;64,64,4;256,64,8'); '' = the kernel's default")
    p.add_argument("--smoke", action="store_true", help="CPU: debug-moe, float32, tiny lengths")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.dtype, a.quant, a.rows, a.layers, a.iters = "debug-moe", "float32", "q8_0", "1,2,8", 2, 2
        a.prompt_len, a.max_tokens = 16, 8
    a.rows_list = [int(r) for r in a.rows.split(",")]
    a.paths = [x.strip() for x in a.paths.split(",") if x.strip()]
    if not a.paths or set(a.paths) - set(PATHS):
        p.error(f"--paths takes a comma list of {', '.join(PATHS)}, got {a.paths!r}")
    a.formats = [None] + [f.strip() for f in a.quant.split(",") if f.strip()]
    from pallas_kernels.gathered_gemv.kernel import GatheredTiles

    try:
        triples = [[int(v) for v in t.split(",")] for t in a.gather_tiles.split(";") if t.strip()]
        if any(len(t) != 3 for t in triples):
            raise ValueError
        a.gather_tiles = [GatheredTiles(*t) for t in triples] or [None]
    except ValueError:
        p.error(f"--gather-tiles takes ';'-separated bi,bo,num_warps triples, got {a.gather_tiles!r}")

    from surojax.bench.shapes import model_config
    from surojax.models.layers.moe import GATHER_CROSSOVER

    cfg = model_config(a.shape)
    if cfg.moe is None:
        p.error(f"--shape {a.shape} is not a MoE shape")
    print(f"# {a.shape}: E {cfg.moe.num_experts}, k {cfg.moe.experts_per_token}, auto gathers up to "
          f"{int(cfg.moe.num_experts * GATHER_CROSSOVER) // cfg.moe.experts_per_token} rows", flush=True)
    # the engine's child processes first: once this process has used the GPU, jax holds most of its memory
    # (preallocation) and a child serving the whole model runs out of it (session 26 and 27's engine rows)
    results = [] if a.no_engine else engine_rows(a)
    results = [r for fmt in a.formats for r in layer_rows(a, cfg, fmt)] + results
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
