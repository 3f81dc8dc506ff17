"""Issue 16's H200 job: GRPO on Qwen3-0.6B shapes against TRL's GRPOTrainer, generation against the serve engine's
decode, and DPO against SFT on Qwen3-8B shapes (LoRA). Random weights (speed does not depend on them).

Items (`--only a,b,...`, run in the order grpo, trl, engine, sft8b, dpo8b, each in its own process so no two hold the
GPU at once):
  grpo    ours: `python -m surojax.train --config` with `trainer: grpo` (the real entry point, metrics.jsonl's
          generation_time / reference_time / training_time per step)
  trl     anchor: TRL's GRPOTrainer, transformers generation, PEFT LoRA (benchmarks/anchors/trl_grpo_baseline.py;
          needs trl + datasets wheels: `--anchor-python` or the image's python3)
  engine  the serve engine's decode at the same batch: benchmarks/serve_load.py --modes engine, one request per
          completion of a step (R users), the same prompt and completion lengths, greedy, ignore-eos
  sft8b / dpo8b   `surojax bench train --shape qwen3-8b --mode lora`: SFT on rows of --seq tokens vs DPO on pairs
          of two such rows (half the pairs as SFT has rows: the same sequences per micro-batch); DPO's tok/s counts
          both sequences, its step adds the reference forward (the base without the adapter)

Both GRPO sides load the same random bf16 base, an HF folder written once by benchmarks/train_defaults.py.
The GRPO workload (both sides): 64 prompts x 256 prompt tokens per optimizer step, group 8 (512 completions),
512 completion tokens, temperature 1.0, beta 0.04 (a reference pass each step), loss_type dapo, LoRA r16 alpha 32
on all linear layers, learning rate 1e-6, one iteration per generation batch. Micro-batches: ours 32 rows x 16
(sequence_len 768), TRL 16 completions x 32 (its memory with gradient checkpointing; the generation batch is the
same 512). A random model almost never samples its EOS token: every completion runs to 512 tokens on both sides
(completion_length is reported). Prompts are 256 random words of a word-level tokenizer whose vocabulary is the
shape's (one token per word), so prompt lengths are exact on both sides.

Step time: ours the median of steps 2.. (step 1 compiles), TRL its steps after the first. tokens/s per phase:
generation = completion tokens / generation_time; reference = R x (prompt + completion) / reference_time; training
= the same tokens / training_time.

    python3 benchmarks/campaigns/grpo_h200.py --only grpo,engine,sft8b,dpo8b       # H200, ours (one job)
    python3 benchmarks/campaigns/grpo_h200.py --only trl                           # H200, the anchor (trl wheels installed)
    JAX_PLATFORMS=cpu python3 benchmarks/campaigns/grpo_h200.py --tiny --anchor-python /work/refenv/bin/python   # CPU plumbing
One JSON line per item in $OUT/grpo_results.jsonl (and stdout), logs in $OUT/grpo_logs/, the table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # benchmarks/campaigns: grpo_bench_rewards
BENCH = ROOT / "benchmarks"  # the standing tools: train_defaults, serve_load, anchors/
sys.path[:0] = [str(ROOT), str(BENCH)]
ITEMS = ("grpo", "trl", "engine", "sft8b", "dpo8b")
EOS, PAD = "<eos>", "<pad>"


@dataclasses.dataclass(frozen=True)
class Job:
    shape: str
    prompts: int  # per optimizer step
    group: int
    prompt_len: int
    completion_len: int
    micro_rows: int  # ours: rows per micro-batch
    trl_micro: int  # TRL: completions per micro-batch
    steps: int  # ours (step 1 compiles)
    trl_steps: int
    big_shape: str  # the DPO / SFT shape
    big_seq: int
    big_rows: int  # SFT rows per micro-batch (DPO: half as many pairs)
    tiny: bool

    @property
    def rows(self) -> int:
        return self.prompts * self.group


def job_of(a) -> Job:
    if a.tiny:
        return Job("debug", 4, 4, 12, 16, 8, 8, 3, 2, "debug", 64, 4, True)
    return Job("qwen3-0.6b", 64, 8, 256, 512, 32, 16, a.steps, a.trl_steps, "qwen3-8b", 2048, 4, False)


# ---- the shared inputs: shape, tokenizer, prompts ------------------------------------------------------------

def write_inputs(job: Job, work: Path) -> None:
    """config.json of the shape, a word-level tokenizer of its vocabulary (`<pad>` 0, `<eos>` 1, words w2..), and
    `prompts` prompts of exactly `prompt_len` words (= tokens)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    from surojax.bench.shapes import shape_hf_config

    work.mkdir(parents=True, exist_ok=True)
    shape = shape_hf_config(job.shape)
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0), 4096)
    (work / "config.json").write_text(json.dumps(shape))
    vocab = {PAD: 0, EOS: 1, **{f"w{i}": i for i in range(2, shape["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([PAD, EOS])
    (work / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(work / "tokenizer" / "tokenizer.json"))
    (work / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
         "model_max_length": 4096}))
    rng = random.Random(0)
    with open(work / "prompts.jsonl", "w") as f:
        for _ in range(job.prompts * 4):  # four steps' worth: each step samples new prompts
            words = " ".join(f"w{rng.randrange(2, shape['vocab_size'])}" for _ in range(job.prompt_len))
            f.write(json.dumps({"prompt": words}) + "\n")


# ---- items ------------------------------------------------------------------------------------------------

def run_child(cmd: list[str], log: Path, timeout: float, env: dict | None = None, cwd: Path = ROOT):
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout,
                               env={**os.environ, **(env or {})})
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    (log.with_suffix(".out")).write_text(out)
    return out, rc, time.perf_counter() - t0


def phase_rates(rec: dict, job: Job, completion_len: float) -> dict:
    R = job.rows
    seq_tokens = R * (job.prompt_len + completion_len)
    out = {}
    if rec.get("generation_time"):
        out["generation_tok_s"] = R * completion_len / rec["generation_time"]
    if rec.get("reference_time"):
        out["reference_tok_s"] = seq_tokens / rec["reference_time"]
    if rec.get("training_time"):
        out["training_tok_s"] = seq_tokens / rec["training_time"]
    return out


def item_trl(job: Job, work: Path, logs: Path, a) -> dict:
    cmd = [a.anchor_python, str(BENCH / "anchors" / "trl_grpo_baseline.py"), "--work", str(work),
           "--model", str(base_folder(job, work)),
           "--steps", str(job.trl_steps), "--batch", str(job.trl_micro), "--accum", str(job.rows // job.trl_micro),
           "--num-generations", str(job.group), "--max-completion", str(job.completion_len)]
    if job.tiny:
        cmd.append("--cpu")
    out, rc, wall = run_child(cmd, logs / "trl.log", a.timeout)
    summary = [json.loads(ln[8:]) for ln in out.splitlines() if ln.startswith("SUMMARY ")]
    if rc != 0 or not summary:
        return {"item": "trl", "rc": rc, "wall_s": wall, "error": (logs / "trl.log").read_text()[-1500:]}
    steps = summary[0]["steps"]
    timed = steps[1:] or steps
    rec = {k: statistics.median(s[k] for s in timed) for k in
           ("step_time", "generation_time", "reference_time", "training_time")}
    clen = statistics.median(s.get("completion_length") or job.completion_len for s in timed)
    rec.update(item="trl", rc=rc, wall_s=wall, completion_length=clen, first_step_s=steps[0]["step_time"],
               timed_steps=len(timed), peak_gib=summary[0]["peak_gib"], **phase_rates(rec, job, clen))
    return rec


def base_folder(job: Job, work: Path) -> Path:
    """The random bf16 base both sides load (train_defaults.make_base, in a child: this process holds no GPU)."""
    from train_defaults import base_folder as make

    return make(job.shape, work)


def grpo_config(job: Job, work: Path) -> dict:
    cfg = {"trainer": "grpo", "model": str(base_folder(job, work)), "tokenizer": str(work / "tokenizer"),
           "datasets": [{"path": str(work / "prompts.jsonl"), "type": "prompt"}],
           "reward_functions": ["grpo_bench_rewards:distinct_words"],
           "sequence_len": job.prompt_len + job.completion_len, "max_completion_length": job.completion_len,
           "num_generations": job.group, "per_device_train_batch_size": job.micro_rows,
           "gradient_accumulation_steps": job.rows // job.micro_rows, "temperature": 1.0, "beta": 0.04,
           "loss_type": "dapo", "lora": True, "lora_rank": 16, "lora_alpha": 32, "lora_target_modules": "all-linear",
           "learning_rate": 1e-6, "lr_scheduler_type": "constant", "max_steps": job.steps, "logging_steps": 1,
           "save_steps": 10_000, "report_to": ["jsonl"], "seed": 0, "output_dir": str(work / "ours-grpo")}
    if job.tiny:
        cfg["recipe"] = "fp32"
    return cfg


def item_grpo(job: Job, work: Path, logs: Path, a) -> dict:
    cfg = grpo_config(job, work)
    path = work / "grpo.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    env = {"PYTHONPATH": os.pathsep.join(map(str, (ROOT, HERE, BENCH)))}  # grpo_bench_rewards: HERE
    out, rc, wall = run_child([sys.executable, "-m", "surojax.train", "--config", str(path)], logs / "grpo.log",
                              a.timeout, env)
    metrics = Path(cfg["output_dir"]) / "metrics.jsonl"
    steps = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [s for s in steps if "generation_time" in s]
    if rc != 0 or not steps:
        return {"item": "grpo", "rc": rc, "wall_s": wall, "error": (logs / "grpo.log").read_text()[-1500:]}
    timed = steps[1:] or steps
    rec = {k: statistics.median(s[k] for s in timed) for k in
           ("step_time", "generation_time", "reference_time", "training_time")}
    clen = statistics.median(s["completion_length"] for s in timed)
    startup = [ln for ln in (logs / "grpo.log").read_text().splitlines() if "rollout KV pool" in ln or
               ln.startswith("layers") or "recompute" in ln][:4]
    rec.update(item="grpo", rc=rc, wall_s=wall, completion_length=clen, first_step_s=steps[0]["step_time"],
               timed_steps=len(timed), reward=timed[-1].get("reward"), kl=timed[-1].get("kl"), startup=startup,
               **phase_rates(rec, job, clen))
    return rec


def item_engine(job: Job, work: Path, logs: Path, a) -> dict:
    cmd = [sys.executable, str(BENCH / "serve_load.py"), "--modes", "engine", "--users", str(job.rows),
           "--rounds", "1", "--prompt-len", str(job.prompt_len), "--max-tokens", str(job.completion_len),
           "--shape", job.shape]
    if job.tiny:
        cmd += ["--dtype", "float32"]
    out, rc, wall = run_child(cmd, logs / "engine.log", a.timeout)
    results = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not results:
        return {"item": "engine", "rc": rc, "wall_s": wall, "error": (logs / "engine.log").read_text()[-1500:]}
    return {"item": "engine", "rc": rc, "wall_s": wall, **results[-1]}


def item_bench(name: str, job: Job, logs: Path, a) -> dict:
    task = name.removesuffix("8b")
    rows = job.big_rows if task == "sft" else job.big_rows // 2
    cmd = [sys.executable, "-m", "surojax.cli.main", "bench", "train", "--shape", job.big_shape, "--mode", "lora",
           "--task", task, "--segments", "1", "--batch", str(rows), "--seq", str(job.big_seq),
           "--steps", "3" if job.tiny else "5", "--repeats", "1" if job.tiny else "2", "--warmup", "1"]
    if job.tiny:
        cmd += ["--recipe", "fp32"]
    out, rc, wall = run_child(cmd, logs / f"{name}.log", a.timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        return {"item": name, "rc": rc, "wall_s": wall, "error": (logs / f"{name}.log").read_text()[-1500:]}
    r = json.loads(lines[-1])
    return {"item": name, "rc": rc, "wall_s": wall, **{k: r[k] for k in (
        "task", "batch", "seq", "tokens_per_s", "step_ms", "peak_gib", "compile_s", "loss_first", "loss", "mfu")}}


# ---- the table ------------------------------------------------------------------------------------------------

def table(results: dict[str, dict]) -> str:
    lines = ["| item | step s | generation s | reference s | training s | gen tok/s | ref tok/s | train tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("trl", "grpo"):
        r = results.get(name)
        if r and "step_time" in r:
            lines.append(f"| {name} | {r['step_time']:.2f} | {r['generation_time']:.2f} | {r['reference_time']:.2f} | "
                         f"{r['training_time']:.2f} | {r.get('generation_tok_s', 0):,.0f} | "
                         f"{r.get('reference_tok_s', 0):,.0f} | {r.get('training_tok_s', 0):,.0f} |")
    t, g, e = results.get("trl"), results.get("grpo"), results.get("engine")
    if t and g and "step_time" in t and "step_time" in g:
        lines.append(f"\nstep time TRL / ours: **{t['step_time'] / g['step_time']:.2f}x** (target >= 10x)")
    if g and e and "generation_tok_s" in g and e.get("output_tok_s"):
        lines.append(f"generation: ours {g['generation_tok_s']:,.0f} tok/s vs the engine's {e['output_tok_s']:,.0f} "
                     f"output tok/s (decode {e.get('decode_tok_s', 0):,.0f}) at {e.get('users')} users: engine / "
                     f"rollout **{e['output_tok_s'] / g['generation_tok_s']:.2f}x** (target <= 1.5x)")
    s, d = results.get("sft8b"), results.get("dpo8b")
    if s and d and "tokens_per_s" in s and "tokens_per_s" in d:
        lines.append(f"DPO / SFT tok/s ({s.get('batch')} rows vs {d.get('batch')} pairs of {s.get('seq')}): "
                     f"{d['tokens_per_s']:,.0f} / {s['tokens_per_s']:,.0f} = **{d['tokens_per_s'] / s['tokens_per_s']:.2f}x**"
                     " (target >= 0.45x)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(ITEMS))
    p.add_argument("--tiny", action="store_true", help="CPU plumbing: debug shapes, tiny lengths")
    p.add_argument("--steps", type=int, default=4, help="ours: GRPO steps (the first compiles)")
    p.add_argument("--trl-steps", type=int, default=2, help="TRL steps (the first is reported apart)")
    p.add_argument("--anchor-python", default=sys.executable)
    p.add_argument("--work", default="/tmp/surojax-grpo-bench")
    p.add_argument("--timeout", type=float, default=540, help="seconds per item")
    a = p.parse_args()
    job = job_of(a)
    only = [x for x in a.only.split(",") if x]
    unknown = set(only) - set(ITEMS)
    if unknown:
        p.error(f"--only: unknown items {sorted(unknown)}; expected {', '.join(ITEMS)}")
    out_dir = Path(os.environ.get("OUT", "/tmp/surojax-grpo-out"))
    logs = out_dir / "grpo_logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    write_inputs(job, work)
    run = {"trl": item_trl, "grpo": item_grpo, "engine": item_engine}
    results: dict[str, dict] = {}
    for name in (i for i in ITEMS if i in only):
        t0 = time.perf_counter()
        rec = run[name](job, work, logs, a) if name in run else item_bench(name, job, logs, a)
        rec.update(job=dataclasses.asdict(job), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        results[name] = rec
        line = json.dumps(rec)
        print(line, flush=True)
        with open(out_dir / "grpo_results.jsonl", "a") as f:
            f.write(line + "\n")
        print(f"# {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
