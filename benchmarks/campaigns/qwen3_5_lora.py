"""Issue 38's training job: Qwen3.5 shapes, LoRA r16 on every linear (the DeltaNet projections included), seq 2048,
ours against transformers + PEFT in the same job, the anchor with flash-linear-attention's Triton kernels (fla) and
without (transformers' pure-torch chunked rule).

    python3 benchmarks/campaigns/qwen3_5_lora.py --fla-site /tmp/fla-site > $OUT/q35.log 2>&1     # both sizes
    python3 benchmarks/campaigns/qwen3_5_lora.py --only 0.8b                                          # one size
    python3 benchmarks/campaigns/qwen3_5_lora.py --only debug --runs ours,ours-chunked --seq 128      # CPU check

Write its output to a file, never through `| tail` (benchmarks/campaigns/old_vs_new.py says why).

Runs, each in its own process, in this order per size (a ratio is printed as soon as its two figures exist):
    ours            `surojax bench train --shape qwen3.5-<size> --mode lora` with its defaults (the gated delta rule's
                    `impl` auto, what a user gets)
    ours-pallas     the same under SUROJAX_GATED_DELTA=pallas (the Pallas kernels; surojax/kernel_settings.py)
    ours-pallas-v2  the same under SUROJAX_GATED_DELTA=pallas_v2 (fla's forward layout as Pallas kernels)
    ours-chunked    the same under SUROJAX_GATED_DELTA=chunked (the chunked jnp form, XLA)
    hf-fla          benchmarks/anchors/hf_peft_baseline.py --shape qwen3.5-<size> with fla importable
                    (`--fla-site`: a folder fla's wheels were installed into with `pip install --target`;
                    transformers uses fla's kernels when it imports), `--fla-unguarded`: fla 0.6 refuses its gated
                    backward on Hopper with the image's Triton 3.6 (its issue #640) unless tilelang is installed,
                    which is too large to carry; lifting the guard runs the same kernels, so the time is fla's
    hf-torch        the same without fla on the path
Sizes: 0.8b at batch 8 (the anchor at 4), 9b at batch 4 (the anchor at 1), rows of 2048: the anchor at our batch
runs out of memory on an 80 GB H100 (0.8b at 8 rows without fla: 78 GiB in use; with fla: the fp32 logits of the 248,320-token vocabulary, 15 GiB
each, in the loss; measured 2026-12-06); tokens/s are compared, each at its batch. Our rows are packed with
bench train's default segments (the state resets at each): tokens/s counts every position either way.
"""
from __future__ import annotations

import argparse
import os
import sys

from lora_pair import ROOT, anchor_args, ours_args, print_ratios, print_table, report, run

SIZES = {"0.8b": dict(shape="qwen3.5-0.8b", batch=8, hf_batch=4, steps=10, repeats=3, timeout=240),
         "9b": dict(shape="qwen3.5-9b", batch=4, hf_batch=1, steps=5, repeats=2, timeout=240),
         "debug": dict(shape="debug-qwen3.5", batch=2, hf_batch=2, steps=2, repeats=1, timeout=300)}  # CPU: ours only
OURS = {"ours": None, "ours-pallas": "pallas", "ours-pallas-v2": "pallas_v2", "ours-chunked": "chunked"}  # name -> SUROJAX_GATED_DELTA


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(SIZES), help=f"sizes, of {', '.join(SIZES)}")
    ap.add_argument("--runs", default=",".join([*OURS, "hf-fla", "hf-torch"]), help="which runs (module docstring)")
    ap.add_argument("--fla-site", help="folder with fla installed (pip install --target); without it hf-fla skips")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, help="our rows per step (default: the size's)")
    ap.add_argument("--hf-batch", type=int, help="the anchor's rows per step (default: the size's)")
    a = ap.parse_args()
    base_env = {k: v for k, v in os.environ.items() if k != "SUROJAX_GATED_DELTA"}
    base_env["PYTHONPATH"] = str(ROOT)
    runs = a.runs.split(",")
    table: list[tuple[str, str, dict | None]] = []
    for size in a.only.split(","):
        spec = SIZES[size]
        shape = spec["shape"]
        figures: dict[str, float] = {}
        for name in runs:
            env = dict(base_env)
            if name in OURS:
                if OURS[name]:
                    env["SUROJAX_GATED_DELTA"] = OURS[name]
                args = ours_args(shape, batch=a.batch or spec["batch"], seq=a.seq, steps=spec["steps"],
                                 repeats=spec["repeats"])
            elif name in ("hf-fla", "hf-torch"):
                if name == "hf-fla":
                    if not a.fla_site:
                        print(f"[{size} {name}] skipped: no --fla-site", flush=True)
                        continue
                    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{a.fla_site}"
                args = anchor_args(shape, batch=a.hf_batch or spec["hf_batch"], seq=a.seq, steps=spec["steps"])
                if name == "hf-fla":
                    args.append("--fla-unguarded")
            else:
                raise SystemExit(f"qwen3_5_lora: unknown run {name!r}")
            row = report(f"{size} {name}", *run(args, env, spec["timeout"]))
            if row is not None:
                figures[name] = row["tokens_per_s"]
            table.append((size, name, row))
            print_ratios(figures, name, tuple(OURS), ("hf-fla", "hf-torch"))  # the ratios this run completes
    print("\n(ours at batch {}, the anchor at {})".format(a.batch or "the size's", a.hf_batch or "the size's"))
    print_table(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
