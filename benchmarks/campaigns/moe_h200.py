"""Issue 15's H200 job: Qwen3-30B-A3B shapes (48 layers, D 2048, 128 experts top-8, F_e 768, 32 / 4 heads,
head_dim 128, vocab 151936), random weights built on the device, one H200, one job (< 9 minutes with compiles).

Items, in this order (`--only a,c,...` picks some; each runs in its own process, so no two ever share the GPU):
  c  anchor   HF transformers + PEFT LoRA r16 (benchmarks/anchors/hf_moe_baseline.py, a copy of
              shared/bench/hf_moe_baseline.py: shared/ does not reach the GPU machine), same batch and seq as `a`;
              first, while no JAX process holds device memory. Its RESULT line is parsed.
  a  lora     our LoRA r16 training step (`surojax bench train`'s code: surojax/bench/train_bench.py), bf16 base,
              layers scanned (unroll 1: a flat compile in depth), recompute as `recompute: auto` chooses
  b  qlora    the same over a random NF4 base: attention and expert kernels (quant_base.randomize_base, the layout
              quantize_model writes); a line "skipped: ..." where NF4 has no grouped_matmul for the experts
  d  serve    decode tok/s at 1 / 16 / 64 users through the serve Engine (benchmarks/serve_load.py --modes engine:
              32-token prompts, 128 new tokens, greedy)
  e  gmm      ragged_dot vs the Pallas grouped matmul on the expert shapes (benchmarks/grouped_matmul_h200.py,
              default tiles, no tuning)

LoRA targets: `--lora-targets` (default the attention projections: expert LoRA is not on main when this was
written; with it merged, `--lora-targets all-linear` is attention + experts, as on a dense model all-linear is all
seven). The HF anchor is given `--no-expert-lora` when ours trains no expert adapter, so both train the same.
MFU: `mfu` counts model FLOPs as surojax/bench/flops.py does (frozen base 4 x active params, adapters 6 x, attention
per causal pair); `mfu_6n` the "6 x active parameters x tokens + attention" convention MoE figures are quoted in.
Peak memory: the device's peak_bytes_in_use (JAX) / torch.cuda.max_memory_allocated (HF).

One JSON line per measurement in $OUT/moe_results.jsonl (and on stdout), logs in $OUT/moe_logs/, the table last.

    python3 benchmarks/campaigns/moe_h200.py                        # everything, H200
    python3 benchmarks/campaigns/moe_h200.py --only a,c --layers 12 # a reduced-depth model (the table says so)
    JAX_PLATFORMS=cpu python3 benchmarks/campaigns/moe_h200.py --tiny   # CPU plumbing: debug-moe, all items but the anchor
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ITEMS = ("c", "a", "b", "d", "e")  # the run order: the anchor first
NAMES = {"c": "hf-anchor", "a": "ours-lora", "b": "ours-qlora-nf4", "d": "serve", "e": "gmm"}
ATTENTION_TARGETS = "q_proj,k_proj,v_proj,o_proj"
RESERVE_S = {"c": 120, "a": 120, "b": 120, "d": 120, "e": 45}  # an item starting with less budget left is skipped


@dataclasses.dataclass(frozen=True)
class Job:
    shape: str
    layers: int | None  # None: the shape's depth
    batch: int
    seq: int
    segments: int  # packed sequences per row in ours (the anchor's rows are one sequence each)
    lora_targets: str
    steps: int
    repeats: int
    warmup: int
    users: str
    prompt_len: int
    max_tokens: int
    tiny: bool


def job_of(a: argparse.Namespace) -> Job:
    if a.tiny:
        return Job("debug-moe", a.layers, 2, 128, 1, a.lora_targets, 2, 1, 1, "1,4", 16, 8, True)
    return Job("qwen3-30b-a3b", a.layers, a.batch, a.seq, 1, a.lora_targets, a.steps, a.repeats, 1, "1,16,64",
               32, 128, False)


# ---- children ---------------------------------------------------------------------------------------------

def shape_with_layers(job: Job) -> str:
    """The shape name the children use: `--layers N` registers a reduced-depth copy of the shape in this process."""
    from surojax.bench.shapes import SHAPES

    if job.layers is None:
        return job.shape
    name = f"{job.shape}-{job.layers}l"
    SHAPES[name] = {**SHAPES[job.shape], "num_hidden_layers": job.layers}
    return name


def child_train(job: Job, quant: str | None) -> dict:
    """Item a / b in this (child) process."""
    from surojax.bench.train_bench import BenchConfig, run
    from surojax.quant import FORMATS

    if quant is not None and not hasattr(FORMATS[quant], "grouped_matmul"):
        return {"skipped": f"{quant} weights have no grouped_matmul on this checkout (QLoRA over MoE experts, "
                           "issue 15 item 5, not merged): the experts cannot be quantised"}
    bc = BenchConfig(shape=shape_with_layers(job), mode="lora", batch=job.batch, seq=job.seq, steps=job.steps,
                     repeats=job.repeats, warmup=job.warmup, targets=job.lora_targets, recompute="auto",
                     unroll_layers=1, segments=job.segments, quant=quant)
    return run(bc)


def child_main(job: Job, item: str) -> int:
    if item in ("a", "b"):
        r = child_train(job, "nf4" if item == "b" else None)
    else:
        raise ValueError(f"no child item {item!r}")
    print("RESULT " + json.dumps(r), flush=True)
    return 0


# ---- the parent: subprocesses, budget, table --------------------------------------------------------------

def run_cmd(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> tuple[int, list[dict], float]:
    """Run `cmd` (stdout + stderr to `log`); its `RESULT {json}` lines and its exit code."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    results = [parse_result(line) for line in log.read_text().splitlines()]
    return rc, [r for r in results if r is not None], time.perf_counter() - t0


def parse_result(line: str) -> dict | None:
    """A child's measurement: `RESULT {json}` (train, anchor, serve_load) or grouped_matmul_h200's timing lines."""
    if line.startswith("RESULT {"):
        return json.loads(line[len("RESULT "):])
    if line.startswith('{"bench": "grouped_matmul"'):
        r = json.loads(line)
        return r if r.get("kind") == "time" else None
    return None


def item_commands(item: str, job: Job, a: argparse.Namespace) -> list[str] | None:
    py = sys.executable
    if item == "c":
        # gradient checkpointing: without it PEFT's expert wrappers (W + delta materialised per forward) run out of
        # the H200's memory at batch 2 x 2048 (measured); ours recomputes as `recompute: auto` chooses
        cmd = [py, a.anchor, "--batch", str(job.batch), "--seq", str(job.seq), "--steps", str(max(job.steps, 3)),
               "--grad-checkpointing"]
        if "expert" not in job.lora_targets and job.lora_targets != "all-linear":
            cmd.append("--no-expert-lora")
        if job.layers is not None:
            return None  # the anchor script builds 48 layers only
        return cmd
    if item in ("a", "b"):
        return [py, __file__, "--child", item, *a.passthrough]
    if item == "d":
        cmd = [py, "benchmarks/serve_load.py", "--modes", "engine", "--users", job.users, "--rounds", "1",
               "--prompt-len", str(job.prompt_len), "--max-tokens", str(job.max_tokens),
               "--prefills-per-step", "4", "--shape", job.shape]
        if job.tiny:
            cmd += ["--dtype", "float32", "--paged-kernel", "gather"]
        return cmd
    if item == "e":
        return [py, "benchmarks/grouped_matmul_h200.py", "--no-tune", "--iters", "10", "--ragged-fwd-only",
                *(["--tiny"] if job.tiny else [])]
    raise ValueError(item)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(ITEMS), help="comma list of items (a b c d e), run as c a b d e")
    p.add_argument("--layers", type=int, default=None, help="reduced depth (training items; the anchor and serve "
                                                            "are skipped: they build the full shape)")
    p.add_argument("--batch", type=int, default=4, help="rows per step (ours and the anchor)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--lora-targets", default=ATTENTION_TARGETS,
                   help="lora_target_modules of ours (all-linear: attention + experts once expert LoRA exists)")
    p.add_argument("--anchor", default=str(ROOT / "benchmarks/anchors/hf_moe_baseline.py"),
                   help="the HF + PEFT MoE anchor script")
    p.add_argument("--budget-s", type=float, default=530, help="seconds for the whole job")
    p.add_argument("--tiny", action="store_true", help="CPU: debug-moe (2 layers), every item but the anchor")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    a.passthrough = raw
    job = job_of(a)
    if a.child:
        return child_main(job, a.child)

    start = time.perf_counter()
    out = Path(os.environ.get("OUT") or "/tmp/surojax-moe-bench")
    (out / "moe_logs").mkdir(parents=True, exist_ok=True)
    results_path = out / "moe_results.jsonl"
    results_path.write_text("")
    wanted = {x.strip() for x in a.only.split(",") if x.strip()}
    unknown = wanted - set(ITEMS)
    if unknown:
        p.error(f"--only: unknown items {sorted(unknown)} (known: a b c d e)")
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"),
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/surojax-jax-cache"),
           "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "1"}
    rows = []
    for item in [i for i in ITEMS if i in wanted]:
        name = NAMES[item]
        left = a.budget_s - (time.perf_counter() - start)
        record = {"item": name, "shape": job.shape, "layers": job.layers, "batch": job.batch, "seq": job.seq}
        if item == "c" and job.tiny:
            record["skipped"] = "--tiny: the anchor needs CUDA and builds the full shape"
        elif item == "d" and job.layers is not None:
            record["skipped"] = "--layers: the serving item runs the full shape only"
        elif left < (5 if job.tiny else RESERVE_S[item]):
            record["skipped"] = f"budget: {left:.0f}s left, needs ~{RESERVE_S[item]}s"
        if "skipped" in record:
            rows.append(emit(record, results_path))
            continue
        cmd = item_commands(item, job, a)
        if cmd is None:
            rows.append(emit({**record, "skipped": "the anchor builds the 48-layer shape only"}, results_path))
            continue
        print(f"== {name} (t={time.perf_counter() - start:.0f}s): {' '.join(cmd)}", flush=True)
        rc, results, wall = run_cmd(cmd, out / "moe_logs" / f"{name}.log", left, env)
        print(f"   rc={rc} wall={wall:.0f}s, {len(results)} result(s)", flush=True)
        if not results:
            rows.append(emit({**record, "rc": rc, "wall_s": wall, "error": f"no result (see moe_logs/{name}.log)"},
                             results_path))
        for r in results:
            rows.append(emit({**record, **r, "item": name, "rc": rc, "wall_s": wall}, results_path))
    print()
    print(table(rows, job, time.perf_counter() - start))
    return 0 if all("error" not in r for r in rows) else 1


def emit(record: dict, path: Path) -> dict:
    line = json.dumps(record)
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")
    return record


def table(rows: list[dict], job: Job, total_s: float) -> str:
    """One line per measurement: training (tok/s, MFU both ways, peak GiB, ratio to the anchor), serving (decode
    tok/s per user count), gmm (ms per path)."""
    depth = f"{job.layers} layers (REDUCED DEPTH)" if job.layers else "full depth"
    lines = [f"== MoE job: {job.shape}, {depth}, batch {job.batch} x seq {job.seq}, total {total_s:.0f}s"]
    fmt = "{:<16} {:>10} {:>9} {:>7} {:>7} {:>9} {:>8}  {}"
    lines.append(fmt.format("item", "tok/s", "step ms", "MFU", "MFU 6N", "peak GiB", "vs HF", "notes"))
    anchor = next((r for r in rows if r["item"] == "hf-anchor" and r.get("tokens_per_s")), None)
    bf16 = next((r for r in rows if r["item"] == "ours-lora" and r.get("tokens_per_s")), None)
    for r in rows:
        name = r["item"]
        if r.get("skipped") or r.get("error"):
            lines.append(fmt.format(name, "-", "-", "-", "-", "-", "-",
                                    f"skipped: {r['skipped']}" if r.get("skipped") else r["error"]))
        elif name == "serve":
            lines.append(fmt.format(f"serve {r['users']} user{'s' * (r['users'] > 1)}", f"{r['decode_tok_s']:,.0f}",
                                    "", "", "", "", "", f"decode tok/s; ttft p50 {r['ttft_p50_ms']:.0f} ms, "
                                    f"itl p50 {r['itl_p50_ms']:.1f} ms"))
        elif name == "gmm":
            lines.append(fmt.format(f"gmm {r['path']}", "", f"{r['fwd_bwd_ms']:.2f}", "", "", "", "",
                                    f"{r['shape']}: fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TFLOP/s), "
                                    f"fwd+bwd {r['fwd_bwd_tflops']:.0f} TFLOP/s"))
        elif r.get("tokens_per_s"):
            tps, cfg = r["tokens_per_s"], r.get("config", {})
            ratio = f"{tps / anchor['tokens_per_s']:.2f}x" if anchor and name != "hf-anchor" else ""
            if name == "hf-anchor":
                notes = f"HF+PEFT, expert LoRA: {r.get('expert_lora')}, grad ckpt {r.get('grad_ckpt')}"
            else:
                notes = (f"targets {','.join(cfg.get('lora_targets') or [])}; {cfg.get('layer_loop', '')}; "
                         f"compile {r.get('compile_s', 0):.0f}s")
                if name == "ours-qlora-nf4" and bf16:
                    notes = f"{tps / bf16['tokens_per_s']:.2f}x the bf16 base; " + notes
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else ""
            mfu6 = f"{r['mfu_6n']:.1%}" if r.get("mfu_6n") else ""
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else ""
            lines.append(fmt.format(name, f"{tps:,.0f}", f"{r.get('step_ms', 0):.0f}", mfu, mfu6, peak, ratio, notes))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
