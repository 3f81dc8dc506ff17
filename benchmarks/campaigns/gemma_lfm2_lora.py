"""Issue 40's training job: Gemma 3 4B and LFM2-1.2B shapes (surojax.bench.shapes: the published configs, random
weights), LoRA r16 on all-linear at seq 2048, ours at the bench's defaults (what the obvious training YAML gets:
recompute auto, attention auto) against transformers + PEFT (benchmarks/anchors/hf_peft_baseline.py) in the same
job, each run in its own process.

    python3 benchmarks/campaigns/gemma_lfm2_lora.py > $OUT/gl.log 2>&1                   # both shapes, ~7-8 min on an H100
    python3 benchmarks/campaigns/gemma_lfm2_lora.py --only lfm2-1.2b                       # one shape
    python3 benchmarks/campaigns/gemma_lfm2_lora.py --only debug-gemma3,debug-lfm2 --runs ours --seq 128   # CPU

Write its output to a file, never through `| tail` (benchmarks/campaigns/old_vs_new.py says why).

Per shape: `ours` then `hf` at the same batch (Gemma 3 4B: 4 rows, its plan at recompute none is 68 GiB; LFM2-1.2B:
8 rows, 45 GiB). A run that runs out of device memory is retried at half the batch (down to 1 row), so one job gives
a figure for each side; the table shows the batch each ran at, and tokens/s are compared at those. Our rows are
packed with bench train's default segments; tokens/s counts every position either way. Step 1's loss on both
sides is random init's (about ln V; Gemma's embeddings are scaled by sqrt(D) on both): a sanity check, not a parity
test (the parity tests are tests/models/test_hf_parity.py). `--budget-s` bounds the whole job: a run gets at most
the time left (default 480 s, under a 9-minute device call). LFM2 runs first (the cheaper pair).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from lora_pair import ROOT, anchor_args, ours_args, print_ratios, print_table, run_halving

SIZES = {"gemma3-4b": dict(batch=4, steps=5, repeats=2, timeout=270),
         "lfm2-1.2b": dict(batch=8, steps=5, repeats=2, timeout=200),
         "debug-gemma3": dict(batch=2, steps=2, repeats=1, timeout=300),  # CPU: ours only
         "debug-lfm2": dict(batch=2, steps=2, repeats=1, timeout=300)}
RUNS = ("ours", "hf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="lfm2-1.2b,gemma3-4b", help=f"shapes, of {', '.join(SIZES)}")
    ap.add_argument("--runs", default=",".join(RUNS), help="ours, hf (transformers + PEFT; needs CUDA)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, help="rows per step on both sides (default: the shape's)")
    ap.add_argument("--budget-s", type=float, default=480, help="the whole job's time; a run gets what is left")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    deadline = time.monotonic() + a.budget_s
    table: list[tuple[str, str, dict | None]] = []
    ratios: dict[tuple[str, str], float] = {}
    for shape in a.only.split(","):
        spec = SIZES[shape]
        figures: dict[str, float] = {}
        for name in a.runs.split(","):
            if name not in RUNS:
                raise SystemExit(f"gemma_lfm2_lora: unknown run {name!r} (expected {', '.join(RUNS)})")
            def args_for(batch, name=name, spec=spec):
                if name == "ours":
                    return ours_args(shape, batch=batch, seq=a.seq, steps=spec["steps"], repeats=spec["repeats"])
                return anchor_args(shape, batch=batch, seq=a.seq, steps=spec["steps"])

            row = run_halving(f"{shape} {name}", args_for, a.batch or spec["batch"], env, deadline, spec["timeout"])
            if row is not None:
                figures[name] = row["tokens_per_s"]
            table.append((shape, name, row))
            print_ratios(figures, name, ("ours",), ("hf",))
        if "ours" in figures and "hf" in figures:
            ratios[(shape, "ours")] = figures["ours"] / figures["hf"]
    print(f"\n(LoRA r16 all-linear, seq {a.seq}; ratio = our tokens/s over transformers + PEFT's, each at its batch)")
    print_table(table, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
