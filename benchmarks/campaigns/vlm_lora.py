"""Issue 41's GPU job in one call: Qwen3-VL-2B shapes (surojax.bench.shapes, random weights, the vision tower
included) LoRA r16 on image + text rows, ours against transformers + PEFT in the same job, then serving one image
prompt at 1 / 16 users. Each run in its own process.

    python3 benchmarks/campaigns/vlm_lora.py > $OUT/vlm.log 2>&1       # ~6-8 min on an H100
    python3 benchmarks/campaigns/vlm_lora.py --smoke                    # CPU: debug-vl, ours + serving, ~1 min
    python3 benchmarks/campaigns/vlm_lora.py --smoke --runs hf          # CPU: the anchor (a python with torch)

Write its output to a file, never through `| tail` (benchmarks/campaigns/old_vs_new.py says why).

    ours     `surojax bench train --shape qwen3-vl-2b --mode lora --images SIDE --segments 1`: the trainer's step
             on the Trainer's image batches (one SIDE x SIDE image opening each row, its tokens unsupervised, the
             tower frozen in the step), at the bench's defaults (recompute auto, attention auto): what the example
             YAML (configs/examples/lora_qwen3_vl_images.yaml) gets
    hf       benchmarks/anchors/hf_vlm_peft_baseline.py --shape qwen3-vl-2b (transformers + PEFT, sdpa, fused
             AdamW, the same rows: one image then random text, --seq tokens a row)
    serve    benchmarks/campaigns/vlm_serve.py: the engine, one image prompt per user, 128 new tokens

Both training runs count every position of a row as a token; a run out of device memory is retried at half the
batch (down to 1 row). Our MFU counts the language model's FLOPs only. Step 1's loss is random init's (about
ln V, the image tokens unsupervised on both sides): a sanity check, not parity (tests/train/test_vlm_training.py
is the parity test). `--budget-s` bounds the whole job (default 500 s, under a 9-minute device call).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lora_pair import ROOT, print_table, run, run_halving

RUNS = ("ours", "hf", "serve")


def ours_args(shape: str, *, batch: int, seq: int, side: int, steps: int) -> list[str]:
    return ["-m", "surojax.cli.main", "bench", "train", "--shape", shape, "--mode", "lora", "--batch", str(batch),
            "--seq", str(seq), "--images", str(side), "--segments", "1", "--steps", str(steps), "--repeats", "2"]


def anchor_args(shape: str, *, batch: int, seq: int, side: int, steps: int) -> list[str]:
    device = ["--device", "cpu"] if shape.startswith("debug") else []  # --smoke: torch on the CPU
    return ["benchmarks/anchors/hf_vlm_peft_baseline.py", "--shape", shape, "--batch", str(batch), "--seq", str(seq),
            "--side", str(side), "--steps", str(steps), *device]


def serve_args(shape: str, *, side: int, users: str, max_tokens: int) -> list[str]:
    return ["benchmarks/campaigns/vlm_serve.py", "--shape", shape, "--side", str(side), "--users", users,
            "--max-tokens", str(max_tokens)]


def serving_rows(out: str) -> list[dict]:
    """The serving run's records (`RESULT {...}` lines: decode_tok_s, no tokens_per_s)."""
    rows = []
    for ln in out.splitlines():
        if ln.startswith("RESULT {"):
            try:
                rows.append(json.loads(ln.removeprefix("RESULT ")))
            except json.JSONDecodeError:
                pass
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: debug-vl, small sizes, ours + serve")
    ap.add_argument("--runs", help=f"of {', '.join(RUNS)} (default all; --smoke: ours,serve)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step on both sides (halved on OOM)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--side", type=int, default=448, help="image side in pixels (a multiple of 32)")
    ap.add_argument("--budget-s", type=float, default=500)
    a = ap.parse_args()
    shape, steps, users, max_tokens = "qwen3-vl-2b", 5, "1,16", 128
    if a.smoke:
        shape, steps, users, max_tokens, a.batch, a.seq, a.side = "debug-vl", 2, "1,2", 8, 2, 128, 64
    runs = (a.runs or ("ours,serve" if a.smoke else ",".join(RUNS))).split(",")
    bad = [r for r in runs if r not in RUNS]
    if bad:
        raise SystemExit(f"vlm_lora: unknown runs {bad} (expected {', '.join(RUNS)})")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    deadline = time.monotonic() + a.budget_s
    table: list[tuple[str, str, dict | None]] = []
    figures: dict[str, float] = {}
    serving: list[dict] = []
    for name in runs:
        left = deadline - time.monotonic()
        if left < 30:
            print(f"[{name}] skipped: {left:.0f}s of --budget-s left", flush=True)
            table.append((shape, name, None))
            continue
        if name == "serve":
            rc, out, wall = run(serve_args(shape, side=a.side, users=users, max_tokens=max_tokens), env, left)
            serving = [r for r in serving_rows(out) if r.get("mode") == "engine"]
            if not serving:
                print(f"[serve] rc {rc} in {wall:.0f}s, no result:\n{out[-2500:]}", flush=True)
            for r in serving:
                print(f"[serve users {r['users']}] {wall:.0f}s decode {r['decode_tok_s']:.0f} tok/s, TTFT p50 "
                      f"{r['ttft_p50_ms']:.0f} ms", flush=True)
            continue
        make = ours_args if name == "ours" else anchor_args
        row = run_halving(f"{shape} {name}", lambda b: make(shape, batch=b, seq=a.seq, side=a.side, steps=steps),
                          a.batch, env, deadline, 300)
        if row is not None:
            figures[name] = row["tokens_per_s"]
        table.append((shape, name, row))
    ratios = {(shape, "ours"): figures["ours"] / figures["hf"]} if {"ours", "hf"} <= figures.keys() else {}
    print(f"\n(LoRA r16 on the language model, tower frozen; seq {a.seq}, one {a.side}x{a.side} image a row; "
          "ratio = our tokens/s over transformers + PEFT's, each at its batch)")
    print_table(table, ratios)
    if serving:
        print(f"\nserving ({shape}, engine, one {a.side}x{a.side} image prompt a user, {max_tokens} new tokens)")
        print("users  prompt tok  decode tok/s  output tok/s  TTFT p50 ms  TTFT p99 ms")
        for r in serving:
            print(f"{r['users']:>5} {r['prompt_tokens']:>11} {r['decode_tok_s']:>13.0f} {r['output_tok_s']:>13.0f} "
                  f"{r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
