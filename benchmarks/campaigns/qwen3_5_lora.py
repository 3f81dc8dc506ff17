"""Issue 38's training job: Qwen3.5 shapes, LoRA r16 on every linear (the DeltaNet projections included), seq 2048,
ours against transformers + PEFT in the same job, the anchor with flash-linear-attention's Triton kernels (fla) and
without (transformers' pure-torch chunked rule).

    python3 benchmarks/campaigns/qwen3_5_lora.py --fla-site /tmp/fla-site > $OUT/q35.log 2>&1     # both sizes
    python3 benchmarks/campaigns/qwen3_5_lora.py --only 0.8b                                          # one size
    python3 benchmarks/campaigns/qwen3_5_lora.py --only debug --runs ours,ours-chunked --seq 128      # CPU check

Write its output to a file, never through `| tail` (benchmarks/campaigns/old_vs_new.py says why).

Runs, each in its own process, in this order per size (a ratio is printed as soon as its two figures exist):
    ours            `surojax bench train --shape qwen3.5-<size> --mode lora` with its defaults (the gated delta rule's
                    `impl` auto, what a user gets)
    ours-pallas     the same under SUROJAX_GATED_DELTA=pallas (the Pallas kernels; surojax/kernel_settings.py)
    ours-pallas-v2  the same under SUROJAX_GATED_DELTA=pallas_v2 (fla's forward layout as Pallas kernels)
    ours-chunked    the same under SUROJAX_GATED_DELTA=chunked (the chunked jnp form, XLA)
    hf-fla          benchmarks/anchors/hf_peft_baseline.py --shape qwen3.5-<size> with fla importable
                    (`--fla-site`: a folder fla's wheels were installed into with `pip install --target`;
                    transformers uses fla's kernels when it imports), `--fla-unguarded`: fla 0.6 refuses its gated
                    backward on Hopper with the image's Triton 3.6 (its issue #640) unless tilelang is installed,
                    which is too large to carry; lifting the guard runs the same kernels, so the time is fla's
    hf-torch        the same without fla on the path
Sizes: 0.8b at batch 8 (the anchor at 4), 9b at batch 4 (the anchor at 1), rows of 2048: the anchor at our batch
runs out of memory on an 80 GB H100 (0.8b at 8 rows without fla: 78 GiB in use; with fla: the fp32 logits of the 248,320-token vocabulary, 15 GiB
each, in the loss; measured 2026-12-06); tokens/s are compared, each at its batch. Our rows are packed with
bench train's default segments (the state resets at each): tokens/s counts every position either way.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"0.8b": dict(shape="qwen3.5-0.8b", batch=8, hf_batch=4, steps=10, repeats=3, timeout=240),
         "9b": dict(shape="qwen3.5-9b", batch=4, hf_batch=1, steps=5, repeats=2, timeout=240),
         "debug": dict(shape="debug-qwen3.5", batch=2, hf_batch=2, steps=2, repeats=1, timeout=300)}  # CPU: ours only
OURS = {"ours": None, "ours-pallas": "pallas", "ours-pallas-v2": "pallas_v2", "ours-chunked": "chunked"}  # name -> SUROJAX_GATED_DELTA


def run(args: list[str], env: dict, timeout: int) -> tuple[int, str, float]:
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = p.stdout + "\n" + p.stderr[-4000:], p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else str(e.stdout), 124
    return rc, out, time.perf_counter() - t


def json_rows(out: str) -> list[dict]:
    rows = []
    for ln in out.splitlines():
        ln = ln.strip().removeprefix("RESULT ")
        if ln.startswith("{"):
            try:
                rows.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
    return [r for r in rows if "tokens_per_s" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(SIZES), help=f"sizes, of {', '.join(SIZES)}")
    ap.add_argument("--runs", default=",".join([*OURS, "hf-fla", "hf-torch"]), help="which runs (module docstring)")
    ap.add_argument("--fla-site", help="folder with fla installed (pip install --target); without it hf-fla skips")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, help="our rows per step (default: the size's)")
    ap.add_argument("--hf-batch", type=int, help="the anchor's rows per step (default: the size's)")
    a = ap.parse_args()
    base_env = {k: v for k, v in os.environ.items() if k != "SUROJAX_GATED_DELTA"}
    base_env["PYTHONPATH"] = str(ROOT)
    runs = a.runs.split(",")
    table: list[tuple[str, str, dict | None]] = []
    for size in a.only.split(","):
        spec = SIZES[size]
        shape = spec["shape"]
        figures: dict[str, float] = {}
        for name in runs:
            env = dict(base_env)
            if name in OURS:
                if OURS[name]:
                    env["SUROJAX_GATED_DELTA"] = OURS[name]
                args = ["-m", "surojax.cli.main", "bench", "train", "--shape", shape, "--mode", "lora",
                        "--batch", str(a.batch or spec["batch"]), "--seq", str(a.seq), "--steps", str(spec["steps"]),
                        "--repeats", str(spec["repeats"])]
            elif name in ("hf-fla", "hf-torch"):
                if name == "hf-fla":
                    if not a.fla_site:
                        print(f"[{size} {name}] skipped: no --fla-site", flush=True)
                        continue
                    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{a.fla_site}"
                args = ["benchmarks/anchors/hf_peft_baseline.py", "--shape", shape, "--mode", "lora",
                        "--batch", str(a.hf_batch or spec["hf_batch"]), "--seq", str(a.seq), "--steps", str(spec["steps"])]
                if name == "hf-fla":
                    args.append("--fla-unguarded")
            else:
                raise SystemExit(f"qwen3_5_lora: unknown run {name!r}")
            rc, out, wall = run(args, env, spec["timeout"])
            rows = json_rows(out)
            row = rows[-1] if rows else None
            if row is None:
                print(f"[{size} {name}] rc {rc} in {wall:.0f}s, no result:\n{out[-2500:]}", flush=True)
            else:
                figures[name] = row["tokens_per_s"]
                keep = {k: row.get(k) for k in ("tokens_per_s", "step_ms", "peak_gib", "mfu", "loss", "fla",
                                                "compile_s", "gflops_per_token")}
                print(f"[{size} {name}] {wall:.0f}s " + json.dumps(keep), flush=True)
            table.append((size, name, row))
            for ours in (o for o in figures if o in OURS):  # the ratios this run completes
                for anchor in (h for h in ("hf-fla", "hf-torch") if h in figures and name in (ours, h)):
                    print(f"    {ours} / {anchor} = {figures[ours] / figures[anchor]:.2f}", flush=True)
    print("\n(ours at batch {}, the anchor at {})".format(a.batch or "the size's", a.hf_batch or "the size's"))
    print("size  run            tok/s      step ms  peak GiB   MFU")
    for size, name, row in table:
        if row is None:
            print(f"{size:<5} {name:<14} {'failed':>9}")
        else:
            mfu = row.get("mfu")
            print(f"{size:<5} {name:<14} {row['tokens_per_s']:9.0f} {row['step_ms']:10.1f} "
                  f"{(row.get('peak_gib') or 0):8.1f} {'' if mfu is None else f'{100 * mfu:5.1f}%'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
