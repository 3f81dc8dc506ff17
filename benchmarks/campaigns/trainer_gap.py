"""Where does `python -m surojax.train` lose time against `surojax bench train` on the same shape (issue 37)?

One workload (Qwen3-0.6B shapes, LoRA r16, b8 x 2048, every default), measured three ways in one job, each in its
own child process (one GPU client at a time):

    trainer     the Trainer on train_defaults.py's YAML and data; per step the time of each host phase
                (next host batch, device batch, the jitted call's dispatch, waiting for the metrics) and the
                attention backend it chose (its packing bound M)
    program     the same Trainer's compiled step run back to back on batches already on the device, blocking
                once at the end: the device time of the trainer's program on the trainer's data
    bench       `surojax bench train` with the trainer's M (`--segments M`) and with its default (4)

    python3 benchmarks/campaigns/trainer_gap.py [--steps 20] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def trainer_child(yaml_path: str, steps: int, skip: int) -> dict:
    import jax

    from surojax.config.load import load_config
    from surojax.train.trainers import make_trainer

    tr = make_trainer(load_config(yaml_path))
    phases: dict[str, list[float]] = {"next_batch": [], "device_batch": [], "dispatch": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phases[name].append(time.perf_counter() - t)
            return out
        return wrapper

    tr.next_batch = timed("next_batch", tr.next_batch)
    tr._device_batch = timed("device_batch", tr._device_batch)
    compiled = tr.run.train_step
    tr.run.train_step = timed("dispatch", compiled)
    step_times = [tr.step()["step_time"] for _ in range(steps)]
    tr.run.train_step = compiled
    # the program alone: batches on the device first, then the steps back to back
    batches = [tr._device_batch(tr.next_batch()) for _ in range(4)]
    jax.block_until_ready(batches)
    rng = jax.random.key(0)
    out = None
    for i in range(3):
        tr.trainable, tr.opt_state, out = tr.run.train_step(tr.trainable, tr.frozen, tr.opt_state, batches[i % 4], rng,
                                                            1.0)
    jax.block_until_ready(out)
    n = max(steps - skip, 4)
    t = time.perf_counter()
    for i in range(n):
        tr.trainable, tr.opt_state, out = tr.run.train_step(tr.trainable, tr.frozen, tr.opt_state, batches[i % 4], rng,
                                                            1.0)
    jax.block_until_ready(out)
    program_s = (time.perf_counter() - t) / n
    tokens = tr.plan.tokens_per_step
    med = lambda xs: statistics.median(xs[skip:] or xs)  # noqa: E731
    return {"attention": str(tr.run.spec.model.attention), "tokens_per_step": tokens,
            "trainer_step_ms": round(med(step_times) * 1e3, 2),
            "trainer_tok_s": round(tokens / med(step_times), 1),
            "next_batch_ms": round(med(phases["next_batch"]) * 1e3, 3),
            "device_batch_ms": round(med(phases["device_batch"]) * 1e3, 3),
            "dispatch_ms": round(med(phases["dispatch"]) * 1e3, 3),
            "program_step_ms": round(program_s * 1e3, 2), "program_tok_s": round(tokens / program_s, 1)}


def bench(segments: int | None, smoke: bool) -> dict:
    cmd = [sys.executable, "-m", "surojax.cli.main", "bench", "train", "--shape", "debug" if smoke else "qwen3-0.6b",
           "--mode", "lora", "--batch", "8", "--seq", "64" if smoke else "2048", "--repeats", "2"]
    if segments is not None:
        cmd += ["--segments", str(segments)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"segments": segments, "error": proc.stderr[-1500:]}
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    r = json.loads(line)
    return {"segments": segments, "tok_s": r.get("tokens_per_s"), "step_ms": r.get("step_ms"),
            "attention": r.get("attention_backend")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--work", default="/tmp/surojax-gap")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(trainer_child(a.child, a.steps, a.skip)), flush=True)
        return 0
    import train_defaults as td

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    seq = 64 if a.smoke else 2048
    data = td.write_data(work / "docs.jsonl", docs=400 if a.smoke else 6000, words=seq // 2)
    cfg = td.config("qwen3-0.6b-lora", "default", work, data, a.steps, seq, a.smoke)
    yaml_path = work / "gap.yaml"
    yaml_path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, __file__, "--child", str(yaml_path), "--steps", str(a.steps),
                           "--skip", str(a.skip)], cwd=ROOT, capture_output=True, text=True)
    res = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not res:
        print(proc.stderr[-3000:])
        return 1
    tr = json.loads(res[-1].removeprefix("RESULT "))
    print(json.dumps(tr), flush=True)
    m = tr["attention"].split(":")[1] if tr["attention"].startswith("cudnn:") else None
    rows = [bench(None, a.smoke)] + ([bench(int(m), a.smoke)] if m and m != "4" else [])
    for r in rows:
        print(json.dumps(r), flush=True)
    print(f"\n{'path':34} {'tok/s':>10} {'step ms':>9}")
    print(f"{'trainer (step())':34} {tr['trainer_tok_s']:>10} {tr['trainer_step_ms']:>9}   "
          f"next_batch {tr['next_batch_ms']} ms, device_batch {tr['device_batch_ms']} ms, dispatch "
          f"{tr['dispatch_ms']} ms, {tr['attention']}")
    print(f"{'trainer program, batches on device':34} {tr['program_tok_s']:>10} {tr['program_step_ms']:>9}")
    for r in rows:
        print(f"{'bench --segments ' + str(r['segments'] or 'default'):34} {r.get('tok_s')!s:>10} "
              f"{r.get('step_ms')!s:>9}   {r.get('attention') or r.get('error', '')[-200:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
