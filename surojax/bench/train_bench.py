"""`surojax bench train`: time the trainer's own training step on synthetic packed batches.

Same code path as `surojax sft` (surojax/train/trainer.py), minus data loading and checkpoints: the bench's
options become a TrainConfig (validated by the same config check), `run_spec` turns it into a RunSpec and
`build_run` (surojax/train/build.py) assembles the run exactly as for the Trainer:
    model      from_scratch weights of the real shape, LoRA on all 7 targets; built inside one jit on a one-device
               mesh, so an 8B model is initialised on the GPU, not the host (`--init host`: random values built on
               the host and placed, for models larger than the device)
    precision  the trainer's recipes: bf16 = bf16 compute; LoRA base bf16 + fp32 adapters; full fine-tune fp32
               master weights; fp8_hybrid = bf16 + the FP8 Linear transform
    step       the trainer's jitted step (chunked LM loss, layer loop, optimizer), its buffers donated
    batch      [A, B, T] packed rows: `segments` sequences per row with random lengths (>= min_segment),
               random token ids in [1, V) (never zeros), positions restarting per segment, loss mask 1 on
               every token that has a next token in its segment
    images     `--images SIDE` (a vision-language shape): each row's first sequence opens with one SIDE x SIDE
               image (<|vision_start|>, its (SIDE / patch)^2 / merge^2 image tokens, <|vision_end|>; the image
               tokens unsupervised) with random patch rows, collated and split as the Trainer does
               (train/image_inputs.py: the tower runs in the step, frozen, its pixels replicated); the memory
               plan counts the micro-batch's patches. tokens/s counts every position; MFU counts the language
               model's FLOPs only (the tower's are not in it)

Timing (shared/BENCHMARKS.md): the first call compiles (reported as compile_s, which includes one step),
`warmup` more untimed steps, then `repeats` x `steps` steps, each repeat blocked until ready; step time is
the median over repeats. tokens/s = A * B * T / step time (every position of the packed rows). MFU counts
model FLOPs (surojax/bench/flops.py) against 731 TFLOP/s. Peak memory is the device's peak_bytes_in_use
since the process started (init included: init_peak_gib says what the model build alone reached).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from surojax.bench.flops import PEAK_BF16_FLOPS, flop_targets, step_flops
from surojax.bench.quant_base import GGUF_LEGACY_FORMATS, KERNEL_FORMATS, randomize_base
from surojax.bench.shapes import SHAPES, shape_hf_config
from surojax.config.load import config_from_dict
from surojax.bench.image_rows import image_tokens, synthetic_image_rows
from surojax.data.image_batch import ROPE_KEY, patch_bucket
from surojax.config.schema import TrainConfig
from surojax.losses.dpo import DPOSettings, dpo_loss
from surojax.losses.lm import lm_chunk_tokens
from surojax.kernel_settings import kernel_settings
from surojax.models.layers.attention import packed_backend, runs_per_row
from surojax.models.layers.attention_backend import AUTO as AUTO_ATTENTION, AttentionBackend, as_attention_backend
from surojax.models.vision.inputs import VisionTokens
from surojax.offload.memory_plan import MemoryPlan
from surojax.offload.streaming import host_bytes
from surojax.parallel import batch_parallel_size, batch_sharding, make_mesh
from surojax.peft.lora import adapters_disabled
from surojax.precision.recipe import RECIPES, Recipe
from surojax.quant.base import QuantFormat
from surojax.train.build import Run, build_run, memory_plan_of, resolve_layer_loop
from surojax.train.image_inputs import IMAGES_KEY, step_image_batch
from surojax.train.run_spec import RunSpec, run_spec
from surojax.train.step import compiles_steady_next

STEPS_PLANNED = 10**6  # the bench's learning-rate schedule is constant: the planned length only has to be long


@dataclasses.dataclass
class BenchConfig:
    shape: str = "qwen3-0.6b"
    mode: str = "lora"  # lora | full
    batch: int = 8  # rows per micro-batch
    seq: int = 2048
    accum: int = 1  # micro-batches per optimizer step
    steps: int = 10  # timed steps per repeat
    warmup: int = 2  # untimed steps after the compiling one
    repeats: int = 3
    rank: int = 16
    targets: str = "all-linear"  # lora_target_modules (a MoE model: attention names, gate_up_proj, down_proj, experts)
    alpha: float | None = None  # default 2 * rank (the anchor's)
    recompute: str = "auto"  # the trainer's default: the memory plan picks (resolved in build_run)
    attention: AttentionBackend = AUTO_ATTENTION  # --attention auto | xla | cudnn | cudnn:M | cudnn:M:nocheck
    lmhead_chunks: int = 1
    unroll_layers: int | bool | str = "auto"  # auto (the trainer's) | 1 = rolled layer scan | True = every layer
    recipe: str = "bf16"
    fp8_scaling: str | None = None  # recipe fp8_hybrid: current | delayed | blockwise; None: the config's default
    segments: int = 4  # sequences packed per row
    min_segment: int = 64
    learning_rate: float = 2e-4
    seed: int = 0
    quant: str | None = None  # LoRA over a random quantised base in this format (surojax.bench.quant_base)
    offload_base: bool = False  # LoRA: the stacked base in pinned host memory, streamed per layer
    prefetch: bool = False  # offload_prefetch: the base as per-layer host buffers, layer l+1 fetched during layer l
    # (without offload_base: the same unrolled per-layer loop over a resident base, the exactness protocol's twin)
    base_format: str | None = None  # None: the recipe's dtype; q4_0 / q5_0 / q8_0: a random GGUF block base
    init: str = "jit"  # jit: built on the device (init_sharded); host: random values placed from the host
    optimizer: str = "adamw"  # adamw | adamw_8bit
    offload_optimizer: bool = False  # the layers' optimizer state in pinned host memory, updated per layer
    offload_master: bool = False  # full, bf16: the layers' fp32 master in pinned host memory, bf16 copy on device
    optimizer_layerwise: bool = False  # full: the in-place per-layer update on the device (config optimizer_layerwise)
    task: str = "sft"  # sft: the LM loss on packed rows | dpo: the DPO loss on pairs (`batch` counts pairs)
    parallel: dict | None = None  # config `parallel:` (mesh sizes over every visible device); None: one device
    zero_stage: int | None = None  # config zero_stage (with `parallel`)
    images: int = 0  # side in pixels of one image per row (a vision-language shape); 0: text rows

    def __post_init__(self):
        self.attention = as_attention_backend(self.attention, key="--attention")  # a script's spelling: parsed once

    def check(self) -> None:
        """The bench's own options; everything the trainer also has is checked by the config check
        (`train_config`)."""
        if self.shape not in SHAPES:
            raise ValueError(f"--shape {self.shape!r}: expected one of {', '.join(SHAPES)}")
        if self.mode not in ("lora", "full"):
            raise ValueError(f"--mode {self.mode!r}: expected lora or full")
        if self.task not in ("sft", "dpo"):
            raise ValueError(f"--task {self.task!r}: expected sft or dpo")
        if self.task == "dpo" and (self.mode != "lora" or self.segments != 1):
            raise ValueError("--task dpo: LoRA pairs (the reference is the base without the adapter, one pair's "
                             "sequence per row): use --mode lora --segments 1")
        if self.recipe not in RECIPES:
            raise ValueError(f"--recipe {self.recipe!r}: expected one of {', '.join(RECIPES)}")
        if Recipe(self.recipe).quantizes_linears and (self.quant or self.offload_base or self.base_format
                                                      or self.init == "host"):
            raise ValueError(f"--recipe {self.recipe} quantises a bf16 base built on the device; it does not "
                             "combine with --quant / --offload-base / --base-format / --init host")
        if self.fp8_scaling is not None and Recipe(self.recipe) is not Recipe.FP8_HYBRID:
            raise ValueError(f"--fp8-scaling {self.fp8_scaling} needs --recipe fp8_hybrid")
        for name in ("batch", "seq", "accum", "steps", "repeats", "rank", "lmhead_chunks", "segments"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.base_format is not None and self.base_format not in GGUF_LEGACY_FORMATS:
            raise ValueError(f"--base-format {self.base_format!r}: expected one of {', '.join(GGUF_LEGACY_FORMATS)}")
        if self.quant is not None:
            if self.quant not in KERNEL_FORMATS:
                raise ValueError(f"--quant {self.quant!r}: expected one of {', '.join(KERNEL_FORMATS)}")
            if self.mode != "lora":
                raise ValueError("--quant trains LoRA over a quantised frozen base: use --mode lora")
        if self.init not in ("jit", "host"):
            raise ValueError(f"--init {self.init!r}: expected jit or host")
        if self.base_format and self.mode != "lora":
            raise ValueError("--base-format applies to the frozen base of --mode lora")
        if self.quant is not None and (self.offload_base or self.base_format or self.init == "host"):
            raise ValueError("--quant builds its random quantised base on the device; with --offload-base / "
                             "--init host use --base-format (a random GGUF block base built on the host)")
        if self.images:
            self.check_images()
        if self.segments * max(self.min_segment, 2) > self.seq:
            raise ValueError(f"--segments {self.segments} x --min-segment {self.min_segment} exceeds --seq {self.seq}")

    def check_images(self) -> None:
        vision = shape_hf_config(self.shape).get("vision_config")
        if vision is None:
            raise ValueError(f"--images: --shape {self.shape} has no vision tower (use a vision-language shape: "
                             f"{', '.join(n for n, c in SHAPES.items() if 'vision_config' in c)})")
        if self.task != "sft" or self.parallel is not None or self.zero_stage is not None:
            raise ValueError("--images: one device, --task sft (the trainer's image batches)")
        step = vision["patch_size"] * vision["spatial_merge_size"]
        if self.images < step or self.images % step:
            raise ValueError(f"--images {self.images}: a positive multiple of {step} (patch x merge size)")
        room = self.seq if self.segments == 1 else self.min_segment  # the first sequence's shortest length
        if image_tokens(self.shape, self.images) + 3 > room:
            raise ValueError(f"--images {self.images}: {image_tokens(self.shape, self.images)} image tokens do not "
                             f"fit a row's first sequence ({room} tokens at least: --seq {self.seq}, --segments "
                             f"{self.segments}, --min-segment {self.min_segment})")


@functools.cache
def shape_dir(shape: str) -> str:
    """A model folder holding only the config.json of `shape` (the bench's weights are random, never loaded); one
    folder per shape in the temp directory, rewritten atomically, so repeated runs leave nothing behind."""
    path = Path(tempfile.gettempdir()) / f"surojax-bench-shape-{shape}"
    path.mkdir(exist_ok=True)
    tmp = path / f"config.json.{os.getpid()}"
    tmp.write_text(json.dumps(shape_hf_config(shape)))
    os.replace(tmp, path / "config.json")
    return str(path)


def train_config(bc: BenchConfig) -> TrainConfig:
    """The bench's run as a TrainConfig (the trainer's keys, through the same config check): the architecture of
    `shape` as the model (its weights random: `bench_spec`); the data is the synthetic packed rows below."""
    lora = bc.mode == "lora"
    keys = dict(
        model=shape_dir(bc.shape), seed=bc.seed, attention=bc.attention.kind.value,  # M and check: bench_spec
        recipe=bc.recipe, lora=lora, recompute=bc.recompute, lmhead_chunks=bc.lmhead_chunks,
        unroll_layers=bc.unroll_layers, optimizer=bc.optimizer, learning_rate=bc.learning_rate,
        lr_scheduler_type="constant", sequence_len=bc.seq, per_device_train_batch_size=bc.batch,
        gradient_accumulation_steps=bc.accum, offload_base_weights=bc.offload_base,
        offload_prefetch=bc.prefetch and bc.offload_base, offload_optimizer=bc.offload_optimizer,
        offload_master=bc.offload_master, optimizer_layerwise=bc.optimizer_layerwise, max_steps=STEPS_PLANNED,
        datasets=[{"path": "synthetic", "type": "text"}])
    if bc.fp8_scaling is not None:
        keys.update(fp8_scaling=bc.fp8_scaling)
    if bc.parallel is not None:
        keys.update(parallel=dict(bc.parallel))
    if bc.zero_stage is not None:
        keys.update(zero_stage=bc.zero_stage)
    if lora:
        keys.update(lora_rank=bc.rank, lora_alpha=float(bc.alpha if bc.alpha is not None else 2 * bc.rank),
                    lora_target_modules=bc.targets)
    return config_from_dict(keys)


def bench_spec(bc: BenchConfig) -> RunSpec:
    """The RunSpec of the bench: the TrainConfig's, with the rows' packing bound for attention (`segments` runs
    per row) and the bench's init; `--prefetch` without `--offload-base` is the prefetching loop over a resident
    base, the exactness protocol's twin (a spec, not a user config)."""
    bc.check()
    attention = packed_backend(bc.attention, bc.segments)
    init = "host" if (bc.init == "host" or bc.offload_base or bc.base_format) else "jit"
    spec = run_spec(train_config(bc), total_steps=STEPS_PLANNED, attention=attention, init=init)
    if bc.images:  # the memory plan counts the tower's activations of a micro-batch's patches (as the Trainer)
        merge = shape_hf_config(bc.shape)["vision_config"]["spatial_merge_size"]
        patches = bc.batch * image_tokens(bc.shape, bc.images) * merge ** 2
        spec = spec.replace(batch=dataclasses.replace(spec.batch, image_patches=patch_bucket(patches, merge)))
    if bc.prefetch and not bc.offload_base:
        spec = spec.replace(memory=dataclasses.replace(spec.memory, offload_prefetch=True))
    return spec


# ---- synthetic packed batches -------------------------------------------------------------------------------

def segment_lengths(rng: np.random.Generator, seq: int, segments: int, min_segment: int) -> list[int]:
    """`segments` lengths >= min_segment summing to `seq` (random split)."""
    if segments == 1:
        return [seq]
    free = seq - segments * min_segment
    cuts = np.sort(rng.integers(0, free + 1, size=segments - 1))
    extra = np.diff(np.concatenate([[0], cuts, [free]]))
    return [int(min_segment + e) for e in extra]


def synthetic_batch(rng: np.random.Generator, accum: int, batch: int, seq: int, vocab: int, segments: int,
                    min_segment: int) -> tuple[dict[str, np.ndarray], list[int]]:
    """A packed batch [A, B, T] (surojax/data/batch.py contract) and the lengths of all its segments."""
    shape = (accum, batch, seq)
    out = {"tokens": rng.integers(1, vocab, size=shape, dtype=np.int32),
           "positions": np.zeros(shape, np.int32), "segment_ids": np.zeros(shape, np.int32),
           "targets": np.zeros(shape, np.int32), "loss_mask": np.zeros(shape, np.float32)}
    lengths: list[int] = []
    for a in range(accum):
        for b in range(batch):
            at = 0
            for i, n in enumerate(segment_lengths(rng, seq, segments, min_segment)):
                sl = slice(at, at + n)
                out["positions"][a, b, sl] = np.arange(n)
                out["segment_ids"][a, b, sl] = i + 1
                out["targets"][a, b, at:at + n - 1] = out["tokens"][a, b, at + 1:at + n]
                out["loss_mask"][a, b, at:at + n - 1] = 1.0
                lengths.append(n)
                at += n
    return out, lengths


def synthetic_pairs(rng: np.random.Generator, accum: int, pairs: int, seq: int, vocab: int
                    ) -> tuple[dict[str, np.ndarray], list[int]]:
    """DPO pairs [A, P, 2, T] (surojax/losses/dpo.py contract): chosen and rejected share a prompt of T / 2
    tokens, each response fills the rest of its row (loss mask 1 on the response's targets)."""
    shape = (accum, pairs, 2, seq)
    prompt = seq // 2
    tokens = rng.integers(1, vocab, size=shape, dtype=np.int32)
    tokens[..., 1, :prompt] = tokens[..., 0, :prompt]
    targets = np.zeros(shape, np.int32)
    targets[..., :-1] = tokens[..., 1:]
    loss_mask = np.zeros(shape, np.float32)
    loss_mask[..., prompt - 1:seq - 1] = 1.0
    out = {"tokens": tokens, "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy(),
           "segment_ids": np.ones(shape, np.int32), "targets": targets, "loss_mask": loss_mask}
    return out, [seq] * (accum * pairs * 2)


# ---- set-up -------------------------------------------------------------------------------------------------

def bench_mesh(bc: BenchConfig, device=None):
    """One device (`device`, default the first) unless `bc.parallel` / `bc.zero_stage` name a mesh: then the
    Trainer's mesh over every visible device (`TrainConfig.mesh_sizes`: zero_stage 3 spelled as fsdp)."""
    if bc.parallel is None and bc.zero_stage is None:
        return make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=[device or jax.devices()[0]])
    return make_mesh(train_config(bc).mesh_sizes())


def build(bc: BenchConfig, *, device=None) -> Run:
    """The run `build_run` assembles for the bench's spec on its mesh (`bench_mesh`); `--quant` / `--base-format`
    swap a random quantised base into the model before it is placed; `--task dpo` compiles the DPO loss (sigmoid,
    beta 0.1, the reference = the base without the adapter, as DPOTrainer builds it)."""
    spec = bench_spec(bc)
    base_format = bc.quant or bc.base_format  # check() allows at most one of them
    customize = None
    if base_format:
        def customize(model):
            randomize_base(model, base_format, jax.random.key(bc.seed + 1000))
    mesh = bench_mesh(bc, device)
    if bc.task == "dpo":
        loss = functools.partial(dpo_loss, settings=DPOSettings(), without_adapter=adapters_disabled)
        return build_run(spec, mesh, customize=customize, loss=loss)
    return build_run(spec, mesh, customize=customize)


def memory_plan(bc: BenchConfig) -> MemoryPlan:
    """The Trainer's memory plan (surojax/offload/memory_plan.py) of this configuration, with `auto` resolved as
    build_run resolves it."""
    chunk = lm_chunk_tokens(bc.batch, bc.seq, bc.lmhead_chunks)
    spec, _ = resolve_layer_loop(bench_spec(bc), chunk)
    return memory_plan_of(spec, chunk)


def place_batch(setup: Run, batch: dict) -> dict:
    sharding = NamedSharding(setup.mesh, P(None, *batch_sharding(setup.mesh).spec))  # as Trainer.batch_sharding
    if IMAGES_KEY not in batch:
        return jax.device_put(batch, sharding)
    rows = batch_sharding(setup.mesh).spec  # as Trainer._device_image_batch: the images replicated
    images, rope = batch[IMAGES_KEY], batch[ROPE_KEY]
    out = jax.device_put({k: v for k, v in batch.items() if k not in (IMAGES_KEY, ROPE_KEY)}, sharding)
    out[ROPE_KEY] = jax.device_put(rope, NamedSharding(setup.mesh, P(None, None, *rows)))
    out[IMAGES_KEY] = jax.device_put(images, NamedSharding(setup.mesh, P()))
    return out


def _count(tree) -> int:
    """Parameters in a state: a quantised weight counts its logical [..., K, N] values, not its packed bytes."""
    def n(x):
        if isinstance(x, QuantFormat):
            data = x.data  # [..., N*K/2] for nf4, [..., N, row] for the others: the leading dims are layers
            lead = data.shape[:data.ndim - (1 if x.name == "nf4" else 2)]
            return int(np.prod(lead)) * x.shape[0] * x.shape[1]
        return int(np.prod(x.shape))

    return int(sum(n(x) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantFormat))))


def _peak_gib(device) -> float | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**30


def _mesh_peak_gib(mesh) -> float | None:
    """The highest peak of the mesh's devices."""
    peaks = [p for p in (_peak_gib(d) for d in mesh.devices.flat) if p is not None]
    return max(peaks) if peaks else None


# ---- the benchmark ------------------------------------------------------------------------------------------

def run(bc: BenchConfig, log=None) -> dict:
    """Build, compile, time; return the result record (the JSON line)."""
    bc.check()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    device = jax.devices()[0]
    t0 = time.perf_counter()
    setup = build(bc, device=device)
    jax.block_until_ready((setup.trainable, setup.frozen, setup.opt_state))
    init_s = time.perf_counter() - t0
    init_peak = _mesh_peak_gib(setup.mesh)
    n_devices = setup.mesh.size
    rows = bc.batch * batch_parallel_size(setup.mesh)  # per micro-batch, over the mesh (the Trainer's global batch)
    mcfg = setup.model_config
    attention = setup.spec.model.attention
    log(f"built {bc.shape} ({bc.mode}{', base ' + bc.quant if bc.quant else ''}) in {init_s:.1f}s; attention "
        f"{attention}, {setup.layer_loop_reason}, lm-head chunk {setup.chunk} tokens")
    kernels = kernel_settings()
    for line in kernels.summary_lines():  # an A/B override of a kernel choice is never silent
        log(line)

    rng = np.random.default_rng(bc.seed)
    if bc.task == "dpo":
        host_batch, lengths = synthetic_pairs(rng, bc.accum, rows, bc.seq, mcfg.vocab_size)
    else:
        host_batch, lengths = synthetic_batch(rng, bc.accum, rows, bc.seq, mcfg.vocab_size, bc.segments,
                                              bc.min_segment)
    if runs_per_row(host_batch["segment_ids"]) > bc.segments:  # the bound the attention backend was built for
        raise AssertionError(f"synthetic rows hold {runs_per_row(host_batch['segment_ids'])} runs > --segments")
    if bc.images:  # the Trainer's image path: collated rows -> micro-batches with their ImageInputs
        tokens = VisionTokens.from_config(mcfg)
        rows_ = synthetic_image_rows(rng, host_batch, tokens, bc.images, int(mcfg.hf_extra["vision_end_token_id"]))
        host_batch = step_image_batch(rows_, tokens, bc.accum)
    batch = place_batch(setup, host_batch)
    key = jax.random.key(bc.seed)
    trainable, opt_state = setup.trainable, setup.opt_state

    def one():
        nonlocal trainable, opt_state
        trainable, opt_state, m = setup.train_step(trainable, setup.frozen, opt_state, batch, key)
        return m

    t0 = time.perf_counter()
    metrics = jax.block_until_ready(one())
    compile_s = time.perf_counter() - t0
    loss_first = float(metrics["loss"])
    log(f"first step (compile + 1 step) {compile_s:.1f}s, loss {float(metrics['loss']):.4f}")
    if compiles_steady_next(setup.train_step):  # fp8 delayed scaling: its steady program compiles now
        t0 = time.perf_counter()
        jax.block_until_ready(one())
        compile_s += time.perf_counter() - t0
        log(f"second step (fp8 delayed scaling's steady program: compile + 1 step) {time.perf_counter() - t0:.1f}s")
    for _ in range(bc.warmup):
        metrics = one()
    jax.block_until_ready((trainable, opt_state, metrics))
    times = []
    for _ in range(bc.repeats):
        t0 = time.perf_counter()
        for _ in range(bc.steps):
            metrics = one()
        jax.block_until_ready((trainable, opt_state, metrics))
        times.append((time.perf_counter() - t0) / bc.steps)
    step_s = statistics.median(times)
    sequences = rows * (2 if bc.task == "dpo" else 1)  # per micro-batch
    tokens = bc.accum * sequences * bc.seq
    targets = flop_targets(mcfg, bc.targets)
    fl = step_flops(mcfg, mode=bc.mode, tokens=tokens, segment_lengths=lengths, rank=bc.rank, targets=targets)
    fl_6n = step_flops(mcfg, mode="full", tokens=tokens, segment_lengths=lengths)  # 6 x active params x tokens
    n_train, n_frozen = _count(trainable), _count(setup.frozen)
    spec = setup.spec  # what was built: the record reads the spec, the `*_asked` keys the bench's options
    return {
        "impl": "surojax", "task": bc.task,
        "shape": bc.shape, "mode": bc.mode, "batch": bc.batch, "seq": bc.seq, "accum": bc.accum,
        "devices": n_devices, "mesh": {a: int(n) for a, n in setup.mesh.shape.items() if n != 1},
        "rows": rows, "tokens_per_s": tokens / step_s,
        "images": bc.images, "image_tokens_per_row": image_tokens(bc.shape, bc.images) if bc.images else 0,
        "step_ms": step_s * 1e3,
        "step_ms_repeats": [t * 1e3 for t in times],
        "peak_gib": _mesh_peak_gib(setup.mesh),  # the highest of the mesh's devices
        "init_peak_gib": init_peak,
        "plan_gib": setup.memory_plan.total / 2**30,
        "host_gib": (host_bytes(setup.frozen) + host_bytes(opt_state)) / 2**30,
        "mfu": fl["total"] / step_s / PEAK_BF16_FLOPS / n_devices,  # per device
        "mfu_6n": fl_6n["total"] / step_s / PEAK_BF16_FLOPS / n_devices,  # 6 x (active) params: MoE's convention
        "model_tflops_per_s": fl["total"] / step_s / 1e12,
        "gflops_per_token": fl["per_token"] / 1e9,
        "flops_split": {k: fl[k] / fl["total"] for k in ("linear", "adapters", "attention", "linear_attention")},
        "compile_s": compile_s,
        "init_s": init_s,
        "loss": float(metrics["loss"]),
        "loss_first": loss_first,
        "params_trainable": n_train,
        "params_total": n_train + (n_frozen if bc.mode == "lora" else 0),
        "config": {
            "recompute": spec.memory.recompute.value, "attention": str(bc.attention),
            "attention_backend": str(attention), "lmhead_chunks": spec.memory.lmhead_chunks,
            "unroll_layers": spec.memory.unroll,  # as resolved (asked: the two below)
            "recompute_asked": bc.recompute, "unroll_layers_asked": bc.unroll_layers,
            "offload_base": spec.memory.offload_base, "prefetch": bc.prefetch, "base_format": bc.base_format,
            "init": bc.init, "optimizer": spec.optim.name, "offload_optimizer": spec.memory.offload_optimizer,
            "offload_master": spec.memory.offload_master,
            "lm_chunk_tokens": setup.chunk, "rank": spec.lora.adapter.rank if spec.lora is not None else None,
            "lora_targets": list(targets) if bc.mode == "lora" else None, "layer_loop": setup.layer_loop_reason,
            "parallel": bc.parallel, "zero_stage": bc.zero_stage,
            "recipe": spec.precision.recipe, "segments": bc.segments, "min_segment": bc.min_segment, "quant": bc.quant,
            "quant_matmul": kernels.quant_matmul.value if bc.quant else None,
            "kernel_overrides": kernels.overrides(),  # SUROJAX_* variables set for an A/B run (kernel_settings)
            "steps": bc.steps, "repeats": bc.repeats, "warmup": bc.warmup, "lr": bc.learning_rate,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": device.device_kind,
            "jax": jax.__version__,
        },
    }


def main_json(bc: BenchConfig) -> int:
    result = run(bc)
    print(json.dumps(result), flush=True)
    return 0
