"""What the LoRA pair campaigns share (ours against transformers + PEFT, each run in its own process of the same
job: benchmarks/campaigns/qwen3_5_lora.py, gemma_lfm2_lora.py): the two command lines, running one with a time
limit, reading its `RESULT {json}` / JSON line, the per-run line, the ratio lines and the closing table.

    ours     `python -m surojax.cli.main bench train --shape S --mode lora ...` with the bench's defaults (the
             trainer's: recompute auto, the attention backend auto, LoRA r16 on all-linear), what a user's YAML gets
    anchor   benchmarks/anchors/hf_peft_baseline.py --shape S --mode lora (transformers + PEFT, sdpa, fused AdamW)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEEP = ("tokens_per_s", "step_ms", "peak_gib", "mfu", "loss_first", "loss", "fla", "compile_s", "gflops_per_token")


def ours_args(shape: str, *, batch: int, seq: int, steps: int, repeats: int) -> list[str]:
    return ["-m", "surojax.cli.main", "bench", "train", "--shape", shape, "--mode", "lora", "--batch", str(batch),
            "--seq", str(seq), "--steps", str(steps), "--repeats", str(repeats)]


def anchor_args(shape: str, *, batch: int, seq: int, steps: int) -> list[str]:
    return ["benchmarks/anchors/hf_peft_baseline.py", "--shape", shape, "--mode", "lora", "--batch", str(batch),
            "--seq", str(seq), "--steps", str(steps)]


def run(args: list[str], env: dict, timeout: float) -> tuple[int, str, float]:
    """`python args` from the repository root: (exit code, stdout + the tail of stderr, wall seconds); 124 when it
    ran past `timeout`."""
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = p.stdout + "\n" + p.stderr[-4000:], p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else str(e.stdout), 124
    return rc, out, time.perf_counter() - t


def json_rows(out: str) -> list[dict]:
    """The result records a run printed (a `RESULT {...}` or a bare JSON line with tokens_per_s)."""
    rows = []
    for ln in out.splitlines():
        ln = ln.strip().removeprefix("RESULT ")
        if ln.startswith("{"):
            try:
                rows.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
    return [r for r in rows if "tokens_per_s" in r]


def out_of_memory(out: str) -> bool:
    """The run died allocating device memory (torch's OutOfMemoryError, XLA's RESOURCE_EXHAUSTED)."""
    return "OutOfMemoryError" in out or "CUDA out of memory" in out or "RESOURCE_EXHAUSTED" in out


def report(label: str, rc: int, out: str, wall: float) -> dict | None:
    """Print one run's line (its figures, or its exit code and output tail); its last record or None."""
    rows = json_rows(out)
    row = rows[-1] if rows else None
    if row is None:
        print(f"[{label}] rc {rc} in {wall:.0f}s, no result:\n{out[-2500:]}", flush=True)
    else:
        print(f"[{label}] {wall:.0f}s " + json.dumps({k: row.get(k) for k in KEEP if k in row}), flush=True)
    return row


def run_halving(label: str, args_for: Callable[[int], list[str]], batch: int, env: dict, deadline: float,
                timeout: float) -> dict | None:
    """Run `args_for(batch)` (at most `timeout` s, never past `deadline`, a time.monotonic() value); a run out of
    device memory is retried at half the batch, down to 1 row. Each run's line printed; the last record or None."""
    while batch >= 1:
        left = deadline - time.monotonic()
        if left < 30:
            print(f"[{label}] skipped: {left:.0f}s of --budget-s left", flush=True)
            return None
        rc, out, wall = run(args_for(batch), env, min(timeout, left))
        row = report(f"{label} b{batch}", rc, out, wall)
        if row is None and out_of_memory(out) and batch > 1:
            print(f"[{label}] out of memory at batch {batch}: retried at {batch // 2}", flush=True)
            batch //= 2
            continue
        return row
    return None


def print_ratios(figures: dict[str, float], name: str, ours: tuple[str, ...], anchors: tuple[str, ...]) -> None:
    """The ours / anchor tokens/s ratios the run `name` just completed."""
    for o in (o for o in figures if o in ours):
        for h in (h for h in anchors if h in figures and name in (o, h)):
            print(f"    {o} / {h} = {figures[o] / figures[h]:.2f}", flush=True)


def print_table(table: list[tuple[str, str, dict | None]], ratios: dict[tuple[str, str], float] | None = None) -> None:
    """One line per (size, run): batch, tokens/s, step ms, peak GiB, MFU (ours), step 1's loss, and the ratio to
    the anchor where `ratios` has one."""
    ratios = ratios or {}
    print("size         run            batch    tok/s    step ms  peak GiB   MFU   loss@1   ratio")
    for size, name, row in table:
        if row is None:
            print(f"{size:<12} {name:<14} {'':>5} {'failed':>8}")
            continue
        mfu, loss1, ratio = row.get("mfu"), row.get("loss_first"), ratios.get((size, name))
        print(f"{size:<12} {name:<14} {row.get('batch', ''):>5} {row['tokens_per_s']:8.0f} {row['step_ms']:10.1f} "
              f"{(row.get('peak_gib') or 0):8.1f} {'' if mfu is None else f'{100 * mfu:5.1f}%':>6} "
              f"{'' if loss1 is None else f'{loss1:7.3f}':>7} {'' if ratio is None else f'{ratio:6.2f}x':>7}")
