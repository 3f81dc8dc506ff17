"""Does the obvious YAML get the fast path? The real `python -m surojax.train --config` path, per-step tok/s read
from metrics.jsonl, for a YAML with no tuning keys ("default": recompute / unroll_layers auto) against the same YAML
with the hand-tuned layer loop ("tuned": recompute none, every layer unrolled), one workload after the other in one
job. Prints one JSON line per run and a table (default / tuned ratio) at the end.

    python3 benchmarks/train_defaults.py                         # the three workloads of issue 13 on the H200
    python3 benchmarks/train_defaults.py --only qwen3-0.6b-lora  # one workload
    python3 benchmarks/train_defaults.py --smoke                 # CPU plumbing check (debug shapes, 3 steps)

Workloads: Qwen3-0.6B shapes LoRA r16 b8 and full fine-tune b8, Qwen3-8B shapes LoRA r16 b4, seq 2048. LoRA needs
a base folder: random bf16 weights of the shape are built on the device and saved once (`--work`); full
fine-tuning trains from scratch. Data: random-word documents packed into rows of `sequence_len` (the fixture
tokenizer; speed does not depend on which token ids are used). Step time = median over the steps after the first
`--skip` (compile and warm-up); tok/s = rows x sequence_len / step time, as `surojax bench train`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"

WORKLOADS = {  # name: (shape, mode, rows per device)
    "qwen3-0.6b-lora": ("qwen3-0.6b", "lora", 8),
    "qwen3-0.6b-full": ("qwen3-0.6b", "full", 8),
    "qwen3-8b-lora": ("qwen3-8b", "lora", 4),
}
TUNED = {"recompute": "none", "unroll_layers": True}


def write_data(path: Path, docs: int, words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    vocab = ["apples", "Tom", "has", "more", "the", "river", "walks", "seven", "blue", "quickly", "numbers", "sum"]
    with open(path, "w") as f:
        for _ in range(docs):
            n = rng.randint(words // 2, words)
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(n))}) + "\n")
    return path


def base_folder(shape: str, work: Path) -> Path:
    """A model folder of `shape` with random bf16 weights (built on the device, saved once) by a child process:
    this process must not hold a GPU client (it would keep the device memory the runs need)."""
    out = work / f"base-{shape}"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--make-base", shape, "--work", str(work)], cwd=ROOT, check=True)
    return out


def make_base(shape: str, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from surojax.bench.shapes import model_config
    from surojax.models.decoder import Decoder
    from surojax.weights.hf_checkpoint import save_model

    cfg = model_config(shape)

    @jax.jit
    def init():
        return nnx.split(Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))[1]

    graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                        rngs=nnx.Rngs(0))))[0]
    save_model(nnx.merge(graphdef, init()), out, dtype=jnp.bfloat16)


def config(name: str, variant: str, work: Path, data: Path, steps: int, seq: int, smoke: bool) -> dict:
    shape, mode, rows = WORKLOADS[name]
    if smoke:
        shape, rows = "debug", 2
    from surojax.bench.shapes import shape_hf_config

    cfg = {"output_dir": str(work / "runs" / f"{name}-{variant}"), "tokenizer": str(TOKENIZER),
           "datasets": [{"path": str(data), "type": "text"}], "sequence_len": seq,
           "per_device_train_batch_size": rows, "max_steps": steps, "learning_rate": 1e-4,
           "lr_scheduler_type": "constant", "report_to": ["jsonl"], "seed": 0}
    if mode == "lora":
        cfg.update(model=str(base_folder(shape, work)), lora=True, lora_rank=16, lora_alpha=32,
                   lora_target_modules="all-linear")
    else:
        cfg.update(from_scratch=True, model_config=shape_hf_config(shape))
    if smoke:
        cfg["recipe"] = "fp32"
    if variant == "tuned":
        cfg.update(TUNED)
    return cfg


def run_one(name: str, variant: str, cfg: dict, skip: int) -> dict:
    out = Path(cfg["output_dir"])
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    yaml_path = out.parent / f"{name}-{variant}.yaml"
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    yaml_path.write_text(json.dumps(cfg))  # JSON is YAML
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "surojax.train", "--config", str(yaml_path)], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rec = {"workload": name, "variant": variant, "rc": proc.returncode, "wall_s": round(wall, 1)}
    layers = [ln for ln in proc.stderr.splitlines() if ln.startswith("layers")]
    rec["layer_loop"] = layers[0].removeprefix("layers").strip() if layers else None
    if proc.returncode != 0:
        rec["error"] = proc.stderr[-2000:]
        return rec
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    timed = [r["step_time"] for r in steps[skip:]] or [r["step_time"] for r in steps[-1:]]
    step_s = statistics.median(timed)
    tokens = cfg["per_device_train_batch_size"] * cfg["sequence_len"]
    rec.update(step_ms=round(step_s * 1e3, 2), tokens_per_s=round(tokens / step_s, 1),
               first_step_s=round(steps[0]["step_time"], 1), timed_steps=len(timed))
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    ap.add_argument("--variants", default="default,tuned")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--skip", type=int, default=5, help="steps not timed (compile, warm-up)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--work", default=os.environ.get("WORK", "/tmp/surojax-defaults"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--make-base", metavar="SHAPE", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.make_base:
        make_base(a.make_base, Path(a.work) / f"base-{a.make_base}")
        return 0
    if a.smoke:
        a.steps, a.skip, a.seq = 3, 1, 64
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work / "docs.jsonl", docs=400 if a.smoke else 6000, words=a.seq // 2)
    results = []
    for name in a.only.split(","):
        for variant in a.variants.split(","):
            rec = run_one(name, variant, config(name, variant, work, data, a.steps, a.seq, a.smoke), a.skip)
            print(json.dumps(rec), flush=True)
            results.append(rec)
    print(f"\n{'workload':18} {'variant':8} {'tok/s':>10} {'step ms':>9} {'1st step s':>10}  layer loop")
    for r in results:
        print(f"{r['workload']:18} {r['variant']:8} {r.get('tokens_per_s', 'FAIL'):>10} {r.get('step_ms', ''):>9} "
              f"{r.get('first_step_s', ''):>10}  {r.get('layer_loop')}")
    by = {(r["workload"], r["variant"]): r.get("tokens_per_s") for r in results}
    for name in a.only.split(","):
        d, t = by.get((name, "default")), by.get((name, "tuned"))
        if d and t:
            print(f"{name}: default / tuned = {d / t:.3f}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
