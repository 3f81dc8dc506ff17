"""`surojax bench train --shape qwen3-0.6b --mode lora --batch 8 --seq 2048`: time the trainer's training
step on synthetic packed batches with random weights of a real shape; prints one JSON line (tokens/s, step
time, peak memory, MFU, the settings). Every option the trainer also has defaults to the trainer's default
(`--recompute auto`, `--unroll-layers auto`, ...), so the figure is what `python -m surojax.train` gives for that
shape and batch. See surojax/bench/train_bench.py for what is timed and how.

`surojax bench CONFIG [-o key=value]` times a training YAML's own steps (its model, data, trainer kind): the
Trainer it describes, outputs in a temporary folder, no checkpoints; prints one JSON line (step time, tokens/s,
first step with the compile, peak memory). See surojax/bench/config_bench.py.
"""
from __future__ import annotations

import argparse

from surojax.cli.common import UsageError, load_config_args, positive_int

SHAPE_NAMES = ("qwen3-0.6b", "qwen3-8b", "llama3-8b", "qwen3-32b", "llama3-70b", "qwen3.5-0.8b", "qwen3.5-9b",
               "gemma3-1b", "gemma3-4b", "lfm2-1.2b", "qwen3-30b-a3b", "qwen3-small", "qwen3-vl-2b", "debug",
               "debug-moe", "debug-qwen3.5", "debug-gemma3", "debug-vl", "debug-lfm2")  # = surojax.bench.shapes.SHAPES


def _unroll(value: str) -> int | bool | str:
    return "auto" if value == "auto" else True if value == "all" else positive_int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="train|CONFIG", help="`train` (synthetic benchmark) or a training YAML")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="CONFIG only: set a config key (repeatable)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="timed steps per repeat (default 10 for train, 20 for a CONFIG)")
    parser.add_argument("--warmup", type=positive_int, default=None,
                        help="untimed steps after the compiling one (default 2 for train, 3 for a CONFIG)")
    g = parser.add_argument_group("bench train (synthetic packed batches, random weights of a real shape)")
    g.add_argument("--shape", default="qwen3-0.6b", choices=SHAPE_NAMES)
    g.add_argument("--mode", default="lora", choices=("lora", "full"))
    g.add_argument("--task", default="sft", choices=("sft", "dpo"),
                   help="dpo: the DPO loss on pairs of --seq tokens (--batch counts pairs; tokens/s counts both "
                        "sequences; the reference forward is the base without the adapter)")
    g.add_argument("--batch", type=positive_int, default=8, help="rows per micro-batch (default 8)")
    g.add_argument("--seq", type=positive_int, default=2048, help="sequence length (default 2048)")
    g.add_argument("--accum", type=positive_int, default=1, help="micro-batches per step (default 1)")
    g.add_argument("--repeats", type=positive_int, default=3, help="timed repeats; the median is reported")
    g.add_argument("--rank", type=positive_int, default=16, help="LoRA rank (alpha = 2 x rank)")
    g.add_argument("--recompute", default="auto", choices=("auto", "none", "full", "dots", "offload"),
                   help="as the config key (default auto: the trainer's choice, the fastest layer loop that fits)")
    g.add_argument("--attention", default="auto",
                   help="auto | xla | cudnn | cudnn:M | cudnn:M:nocheck (M = max segments per row)")
    g.add_argument("--lmhead-chunks", type=positive_int, default=1,
                   help="split the lm-head + loss into this many chunks of the micro-batch (1: 4096-token chunks)")
    g.add_argument("--unroll-layers", type=_unroll, default="auto", metavar="auto|N|all",
                   help="layers per iteration of the layer scan (1: rolled; all: every layer inlined; default auto: "
                        "the trainer's choice with --recompute)")
    g.add_argument("--recipe", default="bf16", choices=("bf16", "fp32", "fp8_hybrid", "nvfp4"),
                   help="fp8_hybrid: the decoder's Linear GEMMs in FP8; nvfp4: the NVFP4 recipe, emulated "
                        "(docs/precision.md)")
    g.add_argument("--fp8-scaling", default=None, choices=("current", "delayed", "blockwise"),
                   help="--recipe fp8_hybrid: the scaling (config key fp8_scaling; default the config's: delayed, "
                        "current with --offload-optimizer)")
    g.add_argument("--parallel", type=mesh_sizes_arg, default=None, metavar="AXIS=N,...",
                   help="the config's parallel: mesh over every visible device, e.g. data=2 or fsdp=8 or "
                        "stage=2,pipeline_microbatches=4 (default: one device); --batch is then per data shard")
    g.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3), help="the config's zero_stage")
    g.add_argument("--segments", type=positive_int, default=4, help="sequences packed per row (default 4)")
    g.add_argument("--min-segment", type=positive_int, default=64, help="shortest packed sequence (default 64)")
    g.add_argument("--images", type=positive_int, default=0, metavar="SIDE",
                   help="a vision-language shape: one SIDE x SIDE image opens each row's first sequence (random "
                        "pixels, the tower frozen in the step; --segments 1 for the image anchor's rows)")
    g.add_argument("--offload-base", action="store_true",
                   help="LoRA: keep the stacked base in pinned host memory, streamed one layer at a time")
    g.add_argument("--prefetch", action="store_true",
                   help="offload_prefetch (--recompute full): with --offload-base the base as per-layer host "
                        "buffers, layer l+1 fetched while layer l computes; without it the same unrolled loop "
                        "over a resident base (the exactness twin)")
    g.add_argument("--base-format", default=None, choices=("q4_0", "q5_0", "q8_0"),
                   help="LoRA: a random GGUF block-quantised base (built on the host)")
    g.add_argument("--init", default="jit", choices=("jit", "host"),
                   help="jit: random weights built on the device; host: built on the host and placed (forced "
                        "by --offload-base / --base-format)")
    g.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw_8bit"))
    g.add_argument("--offload-optimizer", action="store_true",
                   help="the layers' optimizer state in pinned host memory, updated one layer at a time")
    g.add_argument("--offload-master", action="store_true",
                   help="--mode full --recipe bf16: the layers' fp32 master weights in pinned host memory (the "
                        "device trains their bf16 copy; updated per layer, with or without --offload-optimizer)")
    g.add_argument("--optimizer-layerwise", action="store_true",
                   help="--mode full: update the layers in place one at a time on the device (optimizer_layerwise)")
    g.add_argument("--lr", type=float, default=2e-4)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quant", default=None, choices=("q4_k", "q5_k", "q6_k", "q8_0", "nf4", "nvfp4", "fp8"),
                   help="LoRA over a random base quantised to this format (SUROJAX_QUANT_MATMUL picks the matmul)")


def mesh_sizes_arg(text: str) -> dict[str, int]:
    """`data=2,fsdp=4` -> {"data": 2, "fsdp": 4} (checked as the config's `parallel:` keys)."""
    out = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected AXIS=N (e.g. data=2,fsdp=4)") from None
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"{part!r}: expected AXIS=N (e.g. data=2,fsdp=4)")
    return out


def run(args: argparse.Namespace) -> int:
    if args.config != "train":
        return _bench_config(args)
    # lazy: `surojax COMMAND --help` never imports jax (cli/main.py)
    from surojax.bench.train_bench import BenchConfig, main_json
    from surojax.models.layers.attention_backend import parse_attention_backend

    try:
        bc = BenchConfig(shape=args.shape, mode=args.mode, batch=args.batch, seq=args.seq, accum=args.accum,
                         steps=args.steps or 10, warmup=args.warmup if args.warmup is not None else 2,
                         repeats=args.repeats, rank=args.rank, recompute=args.recompute,
                         attention=parse_attention_backend(args.attention, key="--attention"),
                         lmhead_chunks=args.lmhead_chunks, unroll_layers=args.unroll_layers, recipe=args.recipe,
                         fp8_scaling=args.fp8_scaling, segments=args.segments,
                         min_segment=min(args.min_segment, args.seq // args.segments), learning_rate=args.lr,
                         seed=args.seed, quant=args.quant, offload_base=args.offload_base, prefetch=args.prefetch,
                         base_format=args.base_format, init=args.init, optimizer=args.optimizer,
                         offload_optimizer=args.offload_optimizer, offload_master=args.offload_master,
                         optimizer_layerwise=args.optimizer_layerwise,
                         task=args.task, parallel=args.parallel, zero_stage=args.zero_stage, images=args.images)
        bc.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return main_json(bc)


def _bench_config(args: argparse.Namespace) -> int:
    """`surojax bench CONFIG`: the YAML's own trainer timed (surojax/bench/config_bench.py)."""
    import json

    from surojax.bench.config_bench import run_config

    cfg = load_config_args(args)  # the run reads its model and data: their paths must exist
    result = run_config(cfg, steps=args.steps or 20, warmup=args.warmup if args.warmup is not None else 3)
    print(json.dumps({"config": args.config, **result}), flush=True)
    return 0
