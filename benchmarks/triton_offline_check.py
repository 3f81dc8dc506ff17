"""Compile the fused kernels for an H200 without a GPU: Pallas -> Triton IR (jaxlib's lowering, run for an abstract
"NVIDIA H200" device) -> PTX for sm_90 (the `triton` package's compiler, which needs no GPU). It reports each
kernel's shared memory (the H200 allows 227 KiB = 232,448 B per block), whether it uses wgmma, and whether
registers spill; a tile configuration that fails here will fail on the GPU too. XLA compiles with its own bundled
Triton, so the figures are close, not identical.

Two steps, because the project's environment has jax but not `triton` (any Python with `pip install triton` does):

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/triton_offline_check.py dump /tmp/ttir [--formats q4_k,nf4]
    TRITON_DEFAULT_FP_FUSION=1 /path/to/triton-env/bin/python benchmarks/triton_offline_check.py compile /tmp/ttir

`dump` writes one .ttir file per (format, product, tile configuration of benchmarks/quant_matmul_h200.py) at
the Qwen3-8B shape 4096 x 4096, M = 8192. `dump-paged` writes one per knob setting of
benchmarks/paged_decode_sweep.py's grid (the paged decode-attention kernel, Qwen3-0.6B shapes, 64 rows, a
768-slot block table); `dump-paged-merge` the same kernel and its Pallas partition merge (merge="pallas") at the
default knobs, 1, 8 and 64 rows. `dump-gdn` writes the three kernels of the gated delta rule's "pallas_v2" forward
(pallas_kernels/gated_delta/kernel_v2.py: wy, state, output) at Qwen3.5-0.8B shapes (8 x 2048, H 16, Dk = Dv =
128, bf16) for each setting of GDN_V2_GRID, and the four of its backward (kernel_v2_bwd.py: wy_t, state, dqkw,
wy_bwd) for each of GDN_V2_BWD_GRID. `dump-gemv` writes the decode GEMV (pallas_kernels/decode_gemv) at the
Qwen3-0.6B and Qwen3-8B linears' shapes, M = 1 and 8, for each tile configuration benchmarks/decode_gemv.py sweeps
(and its fused forms: the RMSNorm prologue, the gated product, the residual), and its dot body (GemvTiles.dot) at
M = 1, 9, 16, 64 for each of DOT_CANDIDATES and the default (9 rows: the masked x / residual loads and store). `dump-prologue` writes the decode
prologue (pallas_kernels/decode_prologue: qkv split, q/k norm, rope, the pool write) at Qwen3-0.6B and Qwen3-8B
shapes, 1 and 8 rows, a 65,536-slot bf16 pool, for each of PROLOGUE_KNOBS. `dump-gathered` writes the gathered
GEMV (pallas_kernels/gathered_gemv: MoE decode, each row times its routed expert read in place) at Qwen3-30B-A3B's
expert shapes (gate_up [128, 2048, 1536], down [128, 768, 2048], bf16; an fp32 stack; a ragged [E, 1000, 700]),
A = 8 rows (A sizes only the grid: the module is the same), for each of GATHERED_TILES; `dump-gathered-quant` its
quantised counterpart (gathered_gemv/quant_kernel.py) for each --formats entry and benchmarks/gathered_qgemv.py's
variants; `dump-gemv-quant` the quantised decode GEMV (decode_gemv/quant_kernel.py) at benchmarks/decode_qgemv.py's
linears. `compile` needs only `triton` (it imports nothing else from here); it
also reports registers per thread (the bundled `ptxas -v`), which bound how many programs an SM holds.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

H200_SMEM = 232448  # bytes of shared memory per block (opt-in maximum of sm_90)


@contextlib.contextmanager
def _h200_triton_writer():
    """Yields write(fn, args, path): lower jit `fn` at `args` for an abstract "NVIDIA H200" and write the Triton
    module (MLIR text) of its last pallas_call to `path`. Jaxlib's Triton lowering is wrapped while open."""
    import warnings

    import jax
    from jax._src.pallas.triton import lowering

    warnings.filterwarnings("ignore")  # the Pallas Triton backend's deprecation notice
    # Auto axis: under an Explicit one the avals carry a mesh sharding that the Triton lowering of a row sum
    # ([C, C] -> [C], the gated delta rule's backward) mis-shapes; a GPU lowers with no mesh
    h200 = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200",
                                                                                 num_cores=132, platform="gpu"))
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    original = lowering.lower_jaxpr_to_triton_module
    captured: list[str] = []

    def capture(*args, **kwargs):  # the Triton module of each pallas_call, as MLIR text
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    def write(fn, args, path: str | list[str]) -> None:
        """path: one file (the last pallas_call's module), or one per pallas_call of fn in order."""
        captured.clear()
        with jax.sharding.use_abstract_mesh(h200):
            jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args)
        paths = [path] if isinstance(path, str) else path
        for p, module in zip(paths, captured[-len(paths):]):
            with open(p, "w") as f:
                f.write(module)
            print(p, flush=True)

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield write
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def dump(out: str, formats: list[str]) -> None:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import quant_matmul_h200 as bench

    from pallas_kernels.quant_matmul.kernel import forward, transposed
    from surojax.bench.quant_base import random_weight

    os.makedirs(out, exist_ok=True)
    k = n = 4096
    m = 8192
    with _h200_triton_writer() as write:
        for name in formats:
            w = random_weight(name, k, n, jax.random.key(0))
            for prod, candidates in (("fwd", bench.FWD_TILES), ("dx", bench.BWD_TILES)):
                for tiles in candidates:
                    lw = w.kernel_layout(tiles.kt)
                    a = jnp.zeros((m, k if prod == "fwd" else n), jnp.bfloat16)
                    kernel = forward if prod == "fwd" else transposed
                    write(jax.jit(lambda a, lw, kernel=kernel, tiles=tiles: kernel(a, lw, tiles=tiles)), (a, lw),
                          os.path.join(out, f"{name}_{prod}_{tiles.label()}.ttir"))


def dump_paged_merge(out: str) -> None:
    """The paged decode attention with merge="pallas" at the module's default knobs, Qwen3-0.6B shapes, a 768-slot
    block table, 1, 8 and 64 rows (P = 48, 16, 2 partitions: 64, 16, 2 allocated): both pallas_calls."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import paged_decode_sweep as sweep

    from pallas_kernels.paged_decode import api as pd
    from pallas_kernels.paged_decode.kernel import MERGE_NUM_WARPS

    os.makedirs(out, exist_ok=True)
    m, NB, nblk = sweep.QWEN3_06B, 48, 4096
    pool = jax.ShapeDtypeStruct((m["layers"], nblk * m["block_size"], m["kv_heads"], m["head_dim"]), jnp.bfloat16)
    with _h200_triton_writer() as write:
        for B in (1, 8, 64):
            args = (jax.ShapeDtypeStruct((B, m["heads"], m["head_dim"]), jnp.bfloat16), pool, pool,
                    jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((B, NB), jnp.int32),
                    jax.ShapeDtypeStruct((B,), jnp.int32))
            P = pd.num_partitions(B, m["kv_heads"], NB)
            fn = jax.jit(lambda *a: pd.paged_decode_attention(*a, block_size=m["block_size"], interpret=False,
                                                              merge="pallas"))
            write(fn, args, [os.path.join(out, f"paged_R{B}_P{P}_{pd.QK}-{pd.SPLIT}-it{pd.BLOCKS_PER_ITER}"
                                               f"-w{pd.NUM_WARPS}-s{pd.NUM_STAGES}.ttir"),
                             os.path.join(out, f"paged_merge_R{B}_P{P}-w{MERGE_NUM_WARPS}-s1.ttir")])


def dump_paged(out: str) -> None:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import paged_decode_sweep as sweep

    from pallas_kernels.paged_decode import paged_decode_attention

    os.makedirs(out, exist_ok=True)
    m, B, NB, nblk = sweep.QWEN3_06B, 64, 48, 4096
    pool = jax.ShapeDtypeStruct((m["layers"], nblk * m["block_size"], m["kv_heads"], m["head_dim"]), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((B, m["heads"], m["head_dim"]), jnp.bfloat16), pool, pool,
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((B, NB), jnp.int32),
            jax.ShapeDtypeStruct((B,), jnp.int32))
    with _h200_triton_writer() as write:
        for i, cfg in enumerate(sweep.GRID):
            fn = jax.jit(lambda *a, cfg=cfg: paged_decode_attention(*a, block_size=m["block_size"], interpret=False,
                                                                    **cfg))
            write(fn, args, os.path.join(out, f"paged{i:02d}_{cfg['qk']}-{cfg['split']}-it{cfg['blocks_per_iter']}"
                                              f"-w{cfg['num_warps']}-s{cfg['num_stages']}.ttir"))


# (block_v of the state kernel, block_o of the output kernel, num_warps, num_stages); the wy kernel uses neither block
GDN_V2_GRID = [(bv, bo, w, st) for bv, bo in ((32, 64), (64, 128), (16, 32), (128, 128)) for w in (4, 8)
               for st in (1, 2, 3)]


# the backward's launches (kernel_v2_bwd.BwdKnobs: block_dv of its state kernel, block_dk of its dq / dk / dW kernel,
# warps of wy_t, state, dqkw, wy_bwd, stages)
GDN_V2_BWD_GRID = [(bv, bk, w, st) for bv, bk in ((32, 64), (64, 64), (32, 32), (64, 128))
                   for w in ((4, 4, 8, 8), (4, 4, 4, 4), (8, 8, 8, 8)) for st in (1, 2, 3)]


def dump_gdn(out: str) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta.kernel_v2 import V2Knobs, chunk_forward, operand_shapes
    from pallas_kernels.gated_delta.kernel_v2_bwd import BwdKnobs, chunk_backward

    os.makedirs(out, exist_ok=True)
    D = 128
    args = operand_shapes(8, 2048, 16, D, D, jnp.bfloat16)
    with _h200_triton_writer() as write:
        for bv, bo, w, st in GDN_V2_GRID:
            knobs = V2Knobs(scale=D ** -0.5, interpret=False, block_v=bv, block_o=bo, num_warps=w, num_stages=st)
            fn = jax.jit(lambda *a, knobs=knobs: chunk_forward(*a, knobs=knobs, chunk=64))
            write(fn, args, [os.path.join(out, f"gdnv2_{name}-w{w}-s{st}.ttir")
                             for name in ("wy", f"state-bv{bv}", f"output-bo{bo}")])
        B, Tp, H = 8, 2048, 16
        saved = (jax.ShapeDtypeStruct((B, H, Tp // 64, D, D), jnp.bfloat16),
                 jax.ShapeDtypeStruct((B, Tp, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((B, Tp, H, D), jnp.bfloat16),
                 jax.ShapeDtypeStruct((B, H, D, D), jnp.float32))  # h, v_new, do, ds
        knobs = V2Knobs(scale=D ** -0.5, interpret=False)
        for bv, bk, w, st in GDN_V2_BWD_GRID:
            bwd = BwdKnobs(block_dv=bv, block_dk=bk, wy_warps=w[0], state_warps=w[1], dqkw_warps=w[2],
                           wy_bwd_warps=w[3], num_stages=st)
            fn = jax.jit(lambda *a, bwd=bwd: chunk_backward(*a, knobs=knobs, bwd=bwd, chunk=64))
            names = ("wy_t", f"state-bv{bv}", f"dqkw-bk{bk}", "wy_bwd")
            write(fn, args[:-1] + saved, [os.path.join(out, f"gdnv2bwd_{name}-w{warps}-s{st}.ttir")
                                          for name, warps in zip(names, w)])


def dump_gemv(out: str) -> None:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_gemv as bench
    from pallas_kernels.decode_gemv.api import tiles_for
    from pallas_kernels.decode_gemv.kernel import fit, gemv

    os.makedirs(out, exist_ok=True)
    sd = jax.ShapeDtypeStruct
    with _h200_triton_writer() as write:
        for model, linears in bench.SHAPES.items():
            for lin in linears:
                n_out = lin.n // 2 if lin.gated else lin.n
                for m in (1, 8):
                    for tiles in {tiles_for(n_out, lin.k), *(fit(t, n_out, lin.k) for t in bench.CANDIDATES)}:
                        args = [sd((m, lin.k), jnp.bfloat16), sd((lin.n, lin.k), jnp.bfloat16), sd((), jnp.int32),
                                sd((lin.k,), jnp.bfloat16) if lin.norm else None,
                                sd((m, n_out), jnp.bfloat16) if lin.residual else None]
                        fn = jax.jit(lambda *a, lin=lin, tiles=tiles: gemv(
                            *a, n=lin.n, tiles=tiles, norm="plain" if lin.norm else None,
                            activation="silu" if lin.gated else None))
                        write(fn, args, os.path.join(out, f"gemv_{model}_{lin.name}_m{m}_{tiles.label()}.ttir"))
        for model, linears in bench.SHAPES.items():  # the dot body
            for lin in linears:
                n_out = lin.n // 2 if lin.gated else lin.n
                for m in (1, 9, 16, 64):
                    for tiles in {tiles_for(n_out, lin.k, m), *(fit(t, n_out, lin.k) for t in bench.DOT_CANDIDATES)}:
                        if not tiles.dot:
                            continue
                        args = [sd((m, lin.k), jnp.bfloat16), sd((lin.n, lin.k), jnp.bfloat16), sd((), jnp.int32),
                                sd((lin.k,), jnp.bfloat16) if lin.norm else None,
                                sd((m, n_out), jnp.bfloat16) if lin.residual else None]
                        fn = jax.jit(lambda *a, lin=lin, tiles=tiles: gemv(
                            *a, n=lin.n, tiles=tiles, norm="plain" if lin.norm else None,
                            activation="silu" if lin.gated else None))
                        write(fn, args, os.path.join(out, f"gemvdot_{model}_{lin.name}_m{m}_{tiles.label()}.ttir"))
        for model, (v, d) in HEADS.items():  # a tied head through the kernel: fp32 logits (Decoder.logits)
            for m in (1, 8, 16, 64):
                tiles = tiles_for(v, d, m)
                fn = jax.jit(lambda *a, v=v, tiles=tiles: gemv(*a, n=v, tiles=tiles, out_dtype=jnp.float32))
                write(fn, [sd((m, d), jnp.bfloat16), sd((v, d), jnp.bfloat16), sd((), jnp.int32)],
                      os.path.join(out, f"gemv_{model}_head_m{m}_{tiles.label()}.ttir"))


PROLOGUE_SHAPES = {"qwen3-0.6b": (16, 8, 128, 28), "qwen3-8b": (32, 8, 128, 36)}  # N, K, H, layers
PROLOGUE_WARPS = (1, 2, 4)


def dump_prologue(out: str) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.decode_prologue.kernel import PrologueKnobs, prologue

    os.makedirs(out, exist_ok=True)
    sd = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    with _h200_triton_writer() as write:
        for model, (n, k, h, layers) in PROLOGUE_SHAPES.items():
            pool = sd((layers, 65536, k, h), bf16)
            for m in (1, 8):
                for norm in ("plain", "zero_centered"):
                    for warps in PROLOGUE_WARPS:
                        knobs = PrologueKnobs(num_warps=warps)
                        args = [sd((m, (n + 2 * k) * h), bf16), sd((m, h), bf16), sd((m, h), bf16), pool, pool,
                                sd((), jnp.int32), sd((m,), jnp.int32), sd((h,), bf16), sd((h,), bf16)]
                        fn = jax.jit(lambda *a, n=n, k=k, norm=norm, knobs=knobs: prologue(
                            *a, num_heads=n, num_kv_heads=k, norm=norm, knobs=knobs))
                        write(fn, args, os.path.join(out, f"prologue_{model}_m{m}_{norm}-{knobs.label()}.ttir"))


GATHERED_SHAPES = {"gate_up": (128, 2048, 1536), "down": (128, 768, 2048)}  # Qwen3-30B-A3B experts [E, I, O]
GATHERED_TILES = [(bi, bo, w, st) for bi, bo in ((64, 64), (32, 64), (128, 64), (64, 128), (128, 32))
                  for w in (4, 8) for st in (2, 3)]


def dump_gathered(out: str) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gathered_gemv.kernel import GatheredTiles, fit, gathered_gemv_kernel

    os.makedirs(out, exist_ok=True)
    sd = jax.ShapeDtypeStruct
    cases = [(name, shape, jnp.bfloat16, jnp.bfloat16) for name, shape in GATHERED_SHAPES.items()]
    cases += [("down_f32w", GATHERED_SHAPES["down"], jnp.bfloat16, jnp.float32),  # an fp32 stack cast in-kernel
              ("ragged", (8, 1000, 700), jnp.bfloat16, jnp.bfloat16)]  # the masked loads and store
    with _h200_triton_writer() as write:
        for name, (e, i, o), xdt, wdt in cases:
            for bi, bo, w, st in GATHERED_TILES:
                tiles = fit(GatheredTiles(bi, bo, w, st), i, o)
                fn = jax.jit(lambda *args, e=e, tiles=tiles: gathered_gemv_kernel(*args, num_experts=e, tiles=tiles))
                write(fn, [sd((8, i), xdt), sd((e, i, o), wdt), sd((8,), jnp.int32), sd((1,), jnp.int32)],
                      os.path.join(out, f"gathered_{name}_{tiles.label()}.ttir"))


def dump_gathered_quant(out: str, formats: list[str]) -> None:
    """The gathered quantised GEMV (pallas_kernels/gathered_gemv/quant_kernel.py) at Qwen3-30B-A3B's expert shapes,
    A = 8, each variant of benchmarks/gathered_qgemv.py's defaults, for each format (a 2-layer stack)."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gathered_qgemv as bench

    from pallas_kernels.gathered_gemv.quant_kernel import gathered_quant_kernel
    from surojax.quant.random_weights import random_weight

    os.makedirs(out, exist_ok=True)
    with _h200_triton_writer() as write:
        for fmt in formats:
            for name, (k, n, e) in bench.SHAPES.items():
                lw = bench.lay_out_stack(random_weight(fmt, k, n, jax.random.key(0), (2, e)))
                for t in bench.parse_variants(bench.DEFAULT_VARIANTS):
                    fn = jax.jit(lambda x, lw, ids, base, t=t, e=e: gathered_quant_kernel(x, lw, ids, base,
                                                                                        num_experts=e, tiles=t))
                    label = t.label().replace("-st", "-s")  # compile_all reads -w<warps>-s<stages>
                    write(fn, (jnp.zeros((8, k), jnp.bfloat16), lw, jnp.zeros((8,), jnp.int32),
                               jnp.zeros((1,), jnp.int32)), os.path.join(out, f"qgathered_{fmt}_{name}_{label}.ttir"))


def dump_gemv_quant(out: str, formats: list[str]) -> None:
    """The quantised decode GEMV (pallas_kernels/decode_gemv/quant_kernel.py) at the Qwen3-0.6B and Qwen3-8B linears
    of benchmarks/decode_qgemv.py (their fused forms), one row, bn 4 / 8 / 16, 4 and 8 warps, for each format."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_qgemv as bench

    from pallas_kernels.decode_gemv.api import decode_gemv_quant
    from surojax.quant.random_weights import random_weight

    os.makedirs(out, exist_ok=True)
    with _h200_triton_writer() as write:
        for fmt in formats:
            for shape in ("qwen3-0.6b", "qwen3-8b"):
                for name, (k, n, form) in bench.linears(shape).items():
                    rows = bench.stack_rows(random_weight(fmt, k, n, jax.random.key(0), (2,)))
                    n_out = n // 2 if form.get("activation") else n
                    nw = jnp.zeros((k,), jnp.bfloat16) if form.get("norm") else None
                    r = jnp.zeros((1, n_out), jnp.bfloat16) if form.get("residual") else None
                    for bn in (4, 8, 16):
                        for warps in (4, 8):
                            fn = jax.jit(lambda x, rows, nw, r, bn=bn, warps=warps, n=n, form=form: decode_gemv_quant(
                                x, rows, n=n, layer=1, norm_weight=nw, norm=form.get("norm"),
                                activation=form.get("activation"), residual=r, bn=bn, num_warps=warps,
                                interpret=False))
                            write(fn, (jnp.zeros((1, k), jnp.bfloat16), rows, nw, r),
                                  os.path.join(out, f"qgemv_{fmt}_{shape}_{name}_bn{bn}-w{warps}-s3.ttir"))


HEADS = {"qwen3-0.6b": (151936, 1024), "lfm2-1.2b": (65536, 2048), "gemma3-1b": (262144, 1152)}  # tied [V, D]


def _registers(ptx: str, out_dir: str) -> str:
    """Registers per thread and spill stores from the bundled ptxas -v (sm_90a), or '' where it cannot run."""
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        with tempfile.NamedTemporaryFile("w", suffix=".ptx", dir=out_dir, delete=False) as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                           capture_output=True, text=True, timeout=120)
        os.unlink(f.name)
        regs = re.search(r"Used (\d+) registers", r.stderr)
        spill = re.search(r"(\d+) bytes spill stores", r.stderr)
        return ((f", regs {regs.group(1)}" if regs else "")
                + (f", ptxas spill stores {spill.group(1)} B" if spill else ""))
    except Exception:  # noqa: BLE001 - the register count is a bonus
        return ""


def compile_all(src: str) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    target = GPUTarget("cuda", 90, 32)
    bad = 0
    for fname in sorted(os.listdir(src)):
        if not fname.endswith(".ttir"):
            continue
        m = re.search(r"-w(\d+)-s(\d+)", fname)
        try:
            k = triton_compile(os.path.join(src, fname), target=target,
                               options={"num_warps": int(m.group(1)), "num_stages": int(m.group(2))})
        except Exception as e:  # noqa: BLE001 - report every failure, go on
            bad += 1
            print(f"FAIL {fname}: {type(e).__name__}: {' | '.join(str(e).strip().splitlines()[:3])[:400]}")
            continue
        ptx = k.asm.get("ptx", "")
        smem = k.metadata.shared
        fits = smem <= H200_SMEM
        bad += not fits
        print(f"{'OK  ' if fits else 'SMEM'} {fname}: shared {smem} B{'' if fits else ' > ' + str(H200_SMEM)}, "
              f"wgmma {'yes' if 'wgmma.mma_async' in ptx else 'no'}, spills {'yes' if '.local' in ptx else 'no'}"
              f"{_registers(ptx, src)}")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=("dump", "dump-paged", "dump-paged-merge", "dump-gdn", "dump-gemv", "dump-prologue", "dump-gathered",
                                         "dump-gathered-quant", "dump-gemv-quant", "compile"))
    p.add_argument("dir")
    p.add_argument("--formats", default="q4_k,q5_k,q6_k,q8_0,nf4,nvfp4,fp8")
    args = p.parse_args(argv)
    if args.step == "dump":
        dump(args.dir, [f.strip() for f in args.formats.split(",") if f.strip()])
        return 0
    if args.step == "dump-gdn":
        dump_gdn(args.dir)
        return 0
    if args.step == "dump-gemv":
        dump_gemv(args.dir)
        return 0
    if args.step == "dump-prologue":
        dump_prologue(args.dir)
        return 0
    if args.step == "dump-gathered":
        dump_gathered(args.dir)
        return 0
    if args.step == "dump-gemv-quant":
        dump_gemv_quant(args.dir, [f.strip() for f in args.formats.split(",") if f.strip()])
        return 0
    if args.step == "dump-gathered-quant":
        dump_gathered_quant(args.dir, [f.strip() for f in args.formats.split(",") if f.strip()])
        return 0
    if args.step == "dump-paged":
        dump_paged(args.dir)
        return 0
    if args.step == "dump-paged-merge":
        dump_paged_merge(args.dir)
        return 0
    return compile_all(args.dir)


if __name__ == "__main__":
    sys.exit(main())
