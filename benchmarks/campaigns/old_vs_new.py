"""Old main against new main in one GPU job (issue 37's regression check): the same commands run from two trees,
one after the other, each in its own process, and the new / old ratio per workload printed last.

    python3 benchmarks/campaigns/old_vs_new.py --old .gpu-old [--only trainer,bench,serve,fp8] > $OUT/ovn.log 2>&1

Write its output to a file, never through `| tail`: a job cut by the device's time limit kills the pipe and
returns nothing (session 18 lost its whole job that way); the file keeps every line printed so far.

`--old` is an extracted tree of the old main (`git archive OLD | tar -x -C .gpu-old`); the new tree is this
checkout. Workloads, in this order, each old then new (a figure is printed as soon as both exist, so a job cut
short keeps what it measured; the persistent compilation cache is shared, so a program the new tree compiles
exactly as the old one did is loaded, not compiled again):
    trainer-0.6b-lora   benchmarks/train_defaults.py --only qwen3-0.6b-lora --variants default (python -m surojax.train)
    bench-0.6b-lora     surojax bench train --shape qwen3-0.6b --mode lora --batch 8 --seq 2048 (its defaults)
    bench-8b-lora-fp8   surojax bench train --shape qwen3-8b --mode lora --batch 4 --seq 2048 --recipe fp8_hybrid
    serve-engine-u1/u64 benchmarks/serve_load.py --modes engine --users 1,64 --rounds 1 (Qwen3-0.6B shapes, bf16)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

NEW = Path(__file__).resolve().parents[2]


def run(tree: Path, args: list[str], timeout: int) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or b"").decode(errors="replace")[-2000:] if isinstance(e.stdout, bytes) else str(e), 0.0
    return p.returncode, p.stdout + "\n" + p.stderr[-3000:], time.perf_counter() - t


def last_json(out: str, prefix: str = "{") -> list[dict]:
    rows = []
    for ln in out.splitlines():
        ln = ln.strip()
        if ln.startswith("RESULT "):
            ln = ln.removeprefix("RESULT ")
        elif not ln.startswith(prefix):
            continue
        try:
            rows.append(json.loads(ln))
        except json.JSONDecodeError:
            pass
    return rows


def trainer(tree: Path, work: str) -> dict:
    rc, out, wall = run(tree, ["benchmarks/train_defaults.py", "--only", "qwen3-0.6b-lora", "--variants", "default",
                               "--steps", "20", "--skip", "5", "--work", work], 400)
    rows = [r for r in last_json(out) if r.get("workload") == "qwen3-0.6b-lora"]
    return {"trainer-0.6b-lora": rows[-1].get("tokens_per_s") if rows else None, "_out": out[-1500:] if not rows else ""}


def bench(tree: Path, name: str, extra: list[str], timeout: int) -> dict:
    rc, out, wall = run(tree, ["-m", "surojax.cli.main", "bench", "train", *extra], timeout)
    rows = [r for r in last_json(out) if "tokens_per_s" in r]
    return {name: rows[-1]["tokens_per_s"] if rows else None, "_out": out[-1500:] if not rows else ""}


def serving(tree: Path) -> dict:
    rc, out, wall = run(tree, ["benchmarks/serve_load.py", "--modes", "engine", "--users", "1,64", "--rounds", "1"], 400)
    res = {}
    for r in last_json(out, prefix="RESULT"):
        if r.get("mode") == "engine":
            res[f"serve-engine-u{r['users']}"] = r["decode_tok_s"]
    return {**res, "_out": out[-1500:] if not res else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--only", default="trainer,bench,serve,fp8")
    ap.add_argument("--work", default="/tmp/surojax-ovn")
    a = ap.parse_args()
    trees = {"old": Path(a.old).resolve(), "new": NEW}
    workloads = {
        "trainer": lambda tree: trainer(tree, a.work),
        "bench": lambda tree: bench(tree, "bench-0.6b-lora", ["--shape", "qwen3-0.6b", "--mode", "lora", "--batch", "8",
                                                             "--seq", "2048", "--repeats", "2"], 300),
        "serve": serving,
        "fp8": lambda tree: bench(tree, "bench-8b-lora-fp8", ["--shape", "qwen3-8b", "--mode", "lora", "--batch", "4",
                                                             "--seq", "2048", "--recipe", "fp8_hybrid", "--steps", "5",
                                                             "--repeats", "1"], 420),
    }
    results: dict[str, dict] = {"old": {}, "new": {}}
    for name in a.only.split(","):
        keys: set[str] = set()
        for label in ("old", "new"):
            p = workloads[name](trees[label])
            out = p.pop("_out")
            if out:
                print(f"[{label} {name}] FAILED or no figure:\n{out}", flush=True)
            results[label].update(p)
            keys |= set(p)
        for k in sorted(keys):
            o, n = results["old"].get(k), results["new"].get(k)
            print(f"RATIO {k}: old {o} new {n}" + (f" new/old {n / o:.3f}" if o and n else ""), flush=True)
    print(f"\n{'workload':22} {'old':>12} {'new':>12} {'new/old':>8}")
    for k in results["new"] | results["old"]:
        o, n = results["old"].get(k), results["new"].get(k)
        ratio = f"{n / o:.3f}" if o and n else "-"
        print(f"{k:22} {o!s:>12} {n!s:>12} {ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
