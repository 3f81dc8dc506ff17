"""Issue 20's multi-GPU campaign: data, expert and pipeline parallel scaling and the multi-process launch, on the
GPUs of one host (`nvidia-h200-x2` / `-x4` / `-x8`). Every row is `surojax bench train` (the Trainer's build and
step on random weights of the real shape, synthetic packed rows) in a subprocess of its own that sees only the GPUs
it uses, so the 1-GPU anchor runs in the same job as the N-GPU rows.

    parts    dp-lora   Qwen3-8B LoRA, seq 2048: 1 GPU | data=N (ZeRO-0) | zero_stage 3 (fsdp=N)
             dp-full   Qwen3-8B full fine-tune (adamw_8bit), seq 2048: 1 GPU (the in-place per-layer update, which
                       needs whole parameters) | zero_stage 1 (data=N) | zero_stage 3 (fsdp=N)
             ep        Qwen3-30B-A3B LoRA, seq 2048: 1 GPU | data=N (experts replicated) | expert=N
             pp        Llama-3-70B LoRA over a bf16 base, seq 2048, stage=N with M = N and 2N microbatches: the
                       bubble measured (t(M) = (M + S - 1) t_mb, two M give t_mb) vs predicted (S-1)/(M+S-1)
             launch    the same from-scratch full fine-tune (0.6B shape, data=N) in one process over N GPUs and in
                       N processes of one GPU (`surojax launch --nproc-per-node N`): losses and tokens/s
             ep-profile  the expert=N row of `ep` under the profiler (benchmarks/profile_step.py): its NCCL
                       collectives' time (the token all-gather / psum_scatter over the expert axis, the gradients'
                       sums) against all kernel time, per GPU and step

Per row: tokens/s over all its GPUs, step ms, MFU per GPU, the highest peak GiB. Scaling = tokens/s(N GPUs) /
(N x tokens/s(1 GPU)) of the same part (the issue's target: >= 0.95 on 2 GPUs). One JSON line per row on stdout
(also to $OUT/multi_gpu.jsonl), then the table. A row that fails (out of memory, a refused config) prints its
error and the job goes on.

    PYTHONPATH=$PWD python3 benchmarks/campaigns/multi_gpu_h200.py --parts dp-lora dp-full      # one 10-minute call
    PYTHONPATH=$PWD python3 benchmarks/campaigns/multi_gpu_h200.py --parts ep pp launch
    PYTHONPATH=$PWD python3 benchmarks/campaigns/multi_gpu_h200.py --parts ep-profile
    PYTHONPATH=$PWD python benchmarks/campaigns/multi_gpu_h200.py --smoke      # CPU: 2 virtual devices, debug shapes

Then the scaling model calibrated from these rows (docs/multi_gpu.md), on any machine:

    python benchmarks/tools/scaling_calibration.py $OUT/multi_gpu.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMING = ["--steps", "5", "--warmup", "2", "--repeats", "2"]


def parts(n: int, smoke: bool) -> dict[str, list[tuple[str, int, list[str]]]]:
    """part -> [(row name, GPUs, bench train arguments)]"""
    def shape(real):
        return "debug-moe" if smoke and "a3b" in real else ("debug" if smoke else real)

    seq = ["--seq", "64", "--segments", "2", "--min-segment", "16"] if smoke else ["--seq", "2048"]
    common = seq + ["--recompute", "full"]
    lora8 = ["--shape", shape("qwen3-8b"), "--mode", "lora", "--batch", "4"] + common
    full8 = ["--shape", shape("qwen3-8b"), "--mode", "full", "--batch", "2", "--optimizer", "adamw_8bit"] + common
    moe = ["--shape", shape("qwen3-30b-a3b"), "--mode", "lora", "--batch", "2"] + common
    big = ["--shape", shape("llama3-70b"), "--mode", "lora", "--batch", str(2 * n)] + common
    return {
        "dp-lora": [("1 GPU", 1, lora8), (f"data={n}", n, lora8 + ["--parallel", f"data={n}"]),
                    (f"zero 3 (fsdp={n})", n, lora8 + ["--zero-stage", "3", "--parallel", f"data={n}"])],
        "dp-full": [("1 GPU (layerwise update)", 1, full8 + ["--optimizer-layerwise"]),
                    (f"zero 1 (data={n})", n, full8 + ["--zero-stage", "1", "--parallel", f"data={n}"]),
                    (f"zero 3 (fsdp={n})", n, full8 + ["--zero-stage", "3", "--parallel", f"data={n}"])],
        "ep": [("1 GPU", 1, moe), (f"data={n} (experts replicated)", n, moe + ["--parallel", f"data={n}"]),
               (f"expert={n}", n, moe + ["--parallel", f"expert={n},data=1"])],
        "pp": [(f"stage={n} M={m}", n, big + ["--parallel", f"stage={n},data=1,pipeline_microbatches={m}"])
               for m in (n, 2 * n)],
    }


def device_env(gpus: int, smoke: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    if smoke:
        flags = env.get("XLA_FLAGS", "")
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={gpus}".strip())
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    return env


def bench_row(part: str, name: str, gpus: int, argv: list[str], smoke: bool, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "surojax.cli.main", "bench", "train", *argv,
           *(["--steps", "1", "--warmup", "1", "--repeats", "1"] if smoke else TIMING)]
    row = {"bench": "multi_gpu", "part": part, "row": name, "gpus": gpus, "command": " ".join(cmd[3:])}
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=device_env(gpus, smoke), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {**row, "error": (r.stderr or r.stdout)[-1500:]}
    rec = json.loads(lines[-1])
    keep = ("tokens_per_s", "step_ms", "mfu", "peak_gib", "compile_s", "loss_first", "loss", "mesh", "rows")
    return {**row, **{k: rec.get(k) for k in keep}}


def profile_row(n: int, smoke: bool, timeout: int, out: Path) -> dict:
    """The `ep` part's expert=N step under benchmarks/profile_step.py: NCCL collectives vs all kernels."""
    argv = ["--shape", "debug-moe" if smoke else "qwen3-30b-a3b", "--mode", "lora", "--batch", "2",
            "--seq", "256" if smoke else "2048", "--recompute", "full", "--parallel", f"expert={n},data=1",
            "--steps", "2", "--out", str(out / "ep-profile")]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), *argv]
    row = {"bench": "multi_gpu", "part": "ep-profile", "row": f"expert={n}", "gpus": n,
           "command": "benchmarks/profile_step.py " + " ".join(argv)}
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=device_env(n, smoke), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PROFILE ")]
    if r.returncode or not lines:
        return {**row, "error": (r.stderr or r.stdout)[-1500:]}
    prof = json.loads(lines[-1][len("PROFILE "):])
    return {**row, "kernel_ms": prof["kernel_ms"], "categories_ms": prof["categories_ms"],
            "collectives_ms": prof["categories_ms"].get("collectives (NCCL)", 0.0)}


def add_scaling(rows: list[dict]) -> None:
    """scaling = tokens/s / (GPUs x the part's 1-GPU tokens/s)."""
    one = next((r["tokens_per_s"] for r in rows if r["gpus"] == 1 and r.get("tokens_per_s")), None)
    for r in rows:
        if one and r.get("tokens_per_s"):
            r["scaling"] = r["tokens_per_s"] / (r["gpus"] * one)


def add_bubble(rows: list[dict], stages: int) -> None:
    """From two microbatch counts M1 < M2 at S stages, t(M) = (M + S - 1) t_mb: t_mb = (t2 - t1) / (M2 - M1); the
    measured bubble of each row is (S - 1) t_mb / t(M), the predicted one (S - 1) / (M + S - 1)."""
    ok = [r for r in rows if r.get("step_ms")]
    if len(ok) != 2:
        return
    (m1, t1), (m2, t2) = ((int(r["row"].split("M=")[1]), r["step_ms"]) for r in ok)
    t_mb = (t2 - t1) / (m2 - m1)
    for r, m in zip(ok, (m1, m2)):
        r["bubble_measured"] = (stages - 1) * t_mb / r["step_ms"]
        r["bubble_predicted"] = (stages - 1) / (m + stages - 1)
        r["microbatch_ms"] = t_mb


LAUNCH_MODEL = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 1024, "intermediate_size": 3072,
                "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                "max_position_embeddings": 4096, "tie_word_embeddings": True}


def launch_rows(n: int, smoke: bool, timeout: int) -> list[dict]:
    """The same config trained by one process over n GPUs and by n processes of one GPU each."""
    import yaml

    tmp = Path(tempfile.mkdtemp(prefix="surojax-launch-"))
    data = tmp / "text.jsonl"
    words = "the of and a to in is was he for it with as his on be at by had not are but from or have an".split()
    with open(data, "w") as f:
        for i in range(4000):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(200))}) + "\n")
    model = dict(LAUNCH_MODEL, **({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
                                  if smoke else {}))
    rows = []
    for name, procs in (("1 process", 1), (f"{n} processes", n)):
        cfg = {"from_scratch": True, "model_config": model, "tokenizer": str(ROOT / "configs/quickstart/tokenizer"),
               "datasets": [{"path": str(data), "type": "text"}], "sequence_len": 128 if smoke else 2048,
               "per_device_train_batch_size": 2, "parallel": {"data": n}, "max_steps": 4 if smoke else 30,
               "learning_rate": 1e-3, "lr_scheduler_type": "constant", "logging_steps": 1, "seed": 0,
               "recipe": "fp32" if smoke else "bf16", "report_to": ["jsonl"], "save_steps": 10**6,
               "output_dir": str(tmp / name.replace(" ", "_"))}
        path = tmp / f"{procs}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        train = ["python", "-m", "surojax.train", "--config", str(path)]
        argv = ([sys.executable, "-m", "surojax.cli.main", "launch", "--nproc-per-node", str(n), "--", *train]
                if procs > 1 else [sys.executable, *train[1:]])
        env = device_env(n, smoke)
        if smoke and procs > 1:  # one virtual device per process
            env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(f"device_count={n}", "device_count=1")
        row = {"bench": "multi_gpu", "part": "launch", "row": name, "gpus": n, "command": " ".join(argv[1:])}
        r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        metrics = Path(cfg["output_dir"]) / "metrics.jsonl"
        if r.returncode or not metrics.exists():
            rows.append({**row, "error": r.stderr[-1500:]})
            continue
        steps = [json.loads(ln) for ln in metrics.read_text().splitlines()]
        steps = [s for s in steps if "loss" in s and "step" in s]
        speeds = sorted(s["tokens_per_s"] for s in steps[len(steps) // 2:] if s.get("tokens_per_s"))
        rows.append({**row, "losses": [s["loss"] for s in steps],
                     "tokens_per_s": speeds[len(speeds) // 2] if speeds else None})
    if len(rows) == 2 and "losses" in rows[0] and "losses" in rows[1]:
        a, b = rows[0]["losses"], rows[1]["losses"]
        rows[1]["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if len(a) == len(b) else None
    return rows


def table(rows: list[dict]) -> str:
    out = [f"{'part':<10} {'row':<30} {'GPUs':>4} {'tok/s':>10} {'scaling':>8} {'step ms':>9} {'MFU':>6} "
           f"{'peak GiB':>8}  note"]
    for r in rows:
        note = r.get("error", "").strip().splitlines()[-1][:60] if r.get("error") else ""
        if "bubble_measured" in r:
            note = f"bubble {r['bubble_measured']:.3f} measured, {r['bubble_predicted']:.3f} predicted"
        if "max_loss_rel_diff" in r:
            note = f"losses vs 1 process: max rel diff {r['max_loss_rel_diff']:.2e}"
        if "kernel_ms" in r:
            note = f"NCCL {r['collectives_ms']:.1f} of {r['kernel_ms']:.1f} kernel ms per GPU and step"

        def f(k, fmt):
            return format(r[k], fmt) if r.get(k) is not None else "-"
        out.append(f"{r['part']:<10} {r['row']:<30} {r['gpus']:>4} {f('tokens_per_s', ',.0f'):>10} "
                   f"{f('scaling', '.3f'):>8} {f('step_ms', '.1f'):>9} {f('mfu', '.1%'):>6} "
                   f"{f('peak_gib', '.1f'):>8}  {note}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["dp-lora", "dp-full", "ep", "pp", "launch", "ep-profile"],
                   choices=["dp-lora", "dp-full", "ep", "pp", "launch", "ep-profile"])
    p.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU; --smoke: 2)")
    p.add_argument("--timeout", type=int, default=420, help="seconds per row")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing: virtual devices, debug shapes")
    args = p.parse_args()
    n = args.gpus or (2 if args.smoke else _visible_gpus())
    out = Path(os.environ.get("OUT", tempfile.gettempdir()))
    out.mkdir(parents=True, exist_ok=True)
    plan = parts(n, args.smoke)
    rows: list[dict] = []
    for part in args.parts:
        if part == "launch":
            got = launch_rows(n, args.smoke, args.timeout)
        elif part == "ep-profile":
            got = [profile_row(n, args.smoke, args.timeout, out)]
        else:
            got = [bench_row(part, name, g, argv, args.smoke, args.timeout) for name, g, argv in plan[part]]
            if part == "pp":
                add_bubble(got, n)
            else:
                add_scaling(got)
        for r in got:
            print(json.dumps(r), flush=True)
            with open(out / "multi_gpu.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
        rows += got
    print("\n" + table(rows), file=sys.stderr)
    return 0


def _visible_gpus() -> int:
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return max(1, len([ln for ln in r.stdout.splitlines() if ln.startswith("GPU")]))


if __name__ == "__main__":
    sys.exit(main())
