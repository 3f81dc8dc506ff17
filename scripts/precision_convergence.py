"""Convergence of the precision recipes on the same run: the quickstart's pretraining stage (configs/quickstart.yaml,
data from scripts/make_quickstart_data.py) trained once per recipe with the same data, seed and schedule, through
the trainer itself. Prints the final training / validation losses, the relative gap to bf16, and writes the curves
side by side (PNG) and the numbers (JSON). Deterministic (seed 0); CPU-sized (the quickstart model, 4 layers).

    python scripts/precision_convergence.py                         # bf16, fp8_hybrid (delayed), nvfp4; 400 steps
    python scripts/precision_convergence.py --max-steps 200 --recipes bf16 nvfp4
    python scripts/precision_convergence.py --recipes bf16 fp8_hybrid:current fp8_hybrid:delayed   # RECIPE:fp8_scaling
    # a finished run in OUT/<recipe> is read back, not trained again: recipes can train in parallel processes,
    # then one call without training prints the table and draws the plot

Run from the repository root. Outputs: runs/precision_convergence/<recipe>/ (the runs), --plot, --json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from surojax.config import config_from_dict
from surojax.train.trainer import Trainer


def stage_config(path: Path, stage: str) -> dict:
    """The flat config of one stage: the file's shared keys, then the stage's own."""
    doc = yaml.safe_load(path.read_text())
    stages = {s["name"]: s for s in doc.pop("stages")}
    own = {k: v for k, v in stages[stage].items() if k != "name"}
    return {**doc, **own}


def recipe_keys(name: str) -> dict:
    """`fp8_hybrid` -> {"recipe": "fp8_hybrid"} (its default scaling); `fp8_hybrid:current` -> also
    {"fp8_scaling": "current"}."""
    recipe, _, scaling = name.partition(":")
    return {"recipe": recipe, **({"fp8_scaling": scaling} if scaling else {})}


def run(base: dict, recipe: str, out: Path, overrides: dict) -> dict:
    """Train `recipe` (or read back a finished run of it in OUT/<recipe>); its losses per step."""
    folder = recipe.replace(":", "-")
    cfg = {**base, **overrides, **recipe_keys(recipe), "output_dir": str(out / folder)}
    cfg["eval_steps"] = cfg["save_steps"] = cfg["max_steps"]  # one evaluation and one checkpoint, at the end
    cfg["logging_steps"] = 1  # every step's loss in metrics.jsonl (the curve)
    metrics, seconds = out / folder / "metrics.jsonl", None
    if not (metrics.exists() and _rows(metrics, "eval_loss")):
        start = time.perf_counter()
        Trainer(config_from_dict(cfg)).train()
        seconds = time.perf_counter() - start
    train = _rows(metrics, "loss")
    if train[-1][0] != cfg["max_steps"]:
        raise SystemExit(f"{metrics}: a run of {train[-1][0]} steps, not {cfg['max_steps']}: remove it")
    return {"train": train, "eval": _rows(metrics, "eval_loss"), "seconds": seconds}


def _rows(metrics: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in open(metrics)]
    return [(r["step"], r[key]) for r in rows if key in r and "step" in r]


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe, r in results.items():
        steps, losses = zip(*r["train"])
        ax.plot(steps, losses, label=f"{recipe} (final {r['final_train_loss']:.3f})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/quickstart.yaml"))
    p.add_argument("--stage", default="pretrain")
    p.add_argument("--recipes", nargs="+", default=["bf16", "fp8_hybrid", "nvfp4"],
                   help="recipes to train; fp8_hybrid:current (or :delayed, :blockwise) also sets fp8_scaling")
    p.add_argument("--max-steps", type=int, default=None, help="override the stage's max_steps")
    p.add_argument("--batch", type=int, default=None, help="override the stage's per_device_train_batch_size")
    p.add_argument("--warmup", type=int, default=None, help="override the stage's warmup_steps")
    p.add_argument("--out", type=Path, default=Path("runs/precision_convergence"))
    p.add_argument("--plot", type=Path, default=Path("docs/precision_convergence.png"))
    p.add_argument("--window", type=int, default=20, help="steps averaged for the final training loss")
    p.add_argument("--json", type=Path, default=None, help="default: OUT/results.json")
    args = p.parse_args()
    base = stage_config(args.config, args.stage)
    overrides = {k: v for k, v in (("max_steps", args.max_steps), ("per_device_train_batch_size", args.batch),
                                   ("warmup_steps", args.warmup)) if v is not None}
    results = {recipe: run(base, recipe, args.out, overrides) for recipe in args.recipes}
    for r in results.values():  # final training loss: the mean over the last `window` steps (one batch is noisy)
        r["final_train_loss"] = sum(loss for _, loss in r["train"][-args.window:]) / len(r["train"][-args.window:])
        r["final_eval_loss"] = r["eval"][-1][1] if r["eval"] else float("nan")
    ref = results.get("bf16")
    print(f"{'recipe':<12} {'final train':>12} {'vs bf16':>9} {'final eval':>11} {'vs bf16':>9} {'seconds':>8}")
    for recipe, r in results.items():
        gap = lambda k: (r[k] / ref[k] - 1) * 100 if ref else float("nan")  # noqa: E731
        r["train_gap_vs_bf16_percent"], r["eval_gap_vs_bf16_percent"] = gap("final_train_loss"), gap("final_eval_loss")
        print(f"{recipe:<12} {r['final_train_loss']:>12.4f} {r['train_gap_vs_bf16_percent']:>+8.2f}% "
              f"{r['final_eval_loss']:>11.4f} {r['eval_gap_vs_bf16_percent']:>+8.2f}% {r['seconds'] or 0:>8.0f}")
    steps = max(r["train"][-1][0] for r in results.values())
    plot(results, args.plot, f"{args.config.stem} {args.stage}, {steps} steps: the same data and seed per recipe")
    (args.json or args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
