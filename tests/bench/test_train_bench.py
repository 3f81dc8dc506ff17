"""`surojax bench train` on the CPU-sized `debug` shape: one JSON line with the fields, the trainer's step,
honest synthetic batches, and the FLOP count behind MFU. Tests never assert on time."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from surojax.bench.flops import causal_pairs, step_flops
from surojax.bench.shapes import SHAPES, model_config
from surojax.bench.train_bench import segment_lengths, synthetic_batch
from surojax.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("tokens_per_s", "step_ms", "peak_gib", "mfu", "compile_s", "loss", "config", "shape", "mode", "batch",
          "seq", "gflops_per_token", "params_trainable", "params_total")


def bench(capsys, *args: str) -> tuple[int, str, str]:
    """`surojax bench train --shape debug ARGS` in this process (the console script's `main`): exit code, stdout,
    stderr. Nothing here needs a process of its own, and a new interpreter would import jax again."""
    rc = main(["bench", "train", "--shape", "debug", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bench_train_prints_one_json_line(capsys, mode):
    rc, stdout, stderr = bench(capsys, "--mode", mode, "--steps", "2", "--repeats", "1", "--warmup", "1", "--batch",
                               "2", "--seq", "128")
    assert rc == 0, stderr
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    out = json.loads(lines[0])
    for f in FIELDS:
        assert f in out, f
    assert out["mode"] == mode and out["batch"] == 2 and out["seq"] == 128
    assert out["tokens_per_s"] > 0 and out["step_ms"] > 0 and 0 < out["mfu"] < 1
    assert out["peak_gib"] is None  # the CPU reports no memory stats
    assert abs(out["loss"] - np.log(SHAPES["debug"]["vocab_size"])) < 0.5  # random init: about ln V
    assert out["tokens_per_s"] == pytest.approx(2 * 128 / (out["step_ms"] / 1e3))
    if mode == "lora":
        assert out["params_trainable"] < out["params_total"] / 2
        assert out["config"]["rank"] == 16
    else:
        assert out["params_trainable"] == out["params_total"]
    assert out["config"]["attention"] == "auto" and out["config"]["recompute"] == "none"  # auto, resolved on a CPU
    assert out["config"]["recompute_asked"] == "auto" and out["config"]["unroll_layers_asked"] == "auto"


@pytest.mark.parametrize("shape, batch, want", [("qwen3-0.6b", 8, ("none", True)), ("qwen3-8b", 4, ("full", 1))])
def test_bench_train_defaults_resolve_the_layer_loop_as_the_trainer(monkeypatch, shape, batch, want):
    """`bench train` without tuning flags times the loop `python -m surojax.train` picks for the same keys (it
    timed the rolled scan for 0.6B LoRA, and refused 8B LoRA b4 with recompute none, where the trainer picks full
    recompute): on an 80 GiB device, as the memory plan resolves `auto` in build_run."""
    import argparse

    import surojax.train.build as build_module
    from surojax.bench.train_bench import BenchConfig, bench_spec
    from surojax.cli.bench import add_arguments
    from surojax.losses.lm import lm_chunk_tokens

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["train"])
    assert (args.recompute, args.unroll_layers) == ("auto", "auto") == (BenchConfig.recompute,
                                                                         BenchConfig.unroll_layers)
    monkeypatch.setattr(build_module, "device_capacity", lambda: 80 * 2**30)  # what build_run reads
    bc = BenchConfig(shape=shape, batch=batch)
    spec, _ = build_module.resolve_layer_loop(bench_spec(bc), lm_chunk_tokens(bc.batch, bc.seq, bc.lmhead_chunks))
    assert (spec.memory.recompute.value, spec.memory.unroll) == want


def test_bench_train_bad_argument_is_one_clean_line(capsys):
    rc, _, stderr = bench(capsys, "--attention", "cudnn:1")
    assert rc == 1 and "error:" in stderr and "Traceback" not in stderr


def test_bench_attention_with_a_segment_bound_reaches_the_spec():
    """`--attention cudnn:8` passes the config check (whose key spells the kind only) and builds with M = 8."""
    from surojax.bench.train_bench import BenchConfig, bench_spec

    spec = bench_spec(BenchConfig(shape="debug", attention="cudnn:8:nocheck", batch=2, seq=64, min_segment=8))
    assert str(spec.model.attention) == "cudnn:8:nocheck"


def test_synthetic_batch_is_packed_per_the_batch_contract():
    rng = np.random.default_rng(0)
    b, lengths = synthetic_batch(rng, accum=2, batch=3, seq=256, vocab=1000, segments=4, min_segment=16)
    assert b["tokens"].shape == (2, 3, 256) and len(lengths) == 2 * 3 * 4 and sum(lengths) == 2 * 3 * 256
    assert b["tokens"].min() >= 1 and b["tokens"].max() < 1000  # never zeros
    assert min(lengths) >= 16
    for a in range(2):
        for r in range(3):
            seg, pos, tok = b["segment_ids"][a, r], b["positions"][a, r], b["tokens"][a, r]
            tgt, m = b["targets"][a, r], b["loss_mask"][a, r]
            assert sorted(set(seg.tolist())) == [1, 2, 3, 4]
            for s in range(1, 5):
                idx = np.flatnonzero(seg == s)
                assert (np.diff(idx) == 1).all() and (pos[idx] == np.arange(len(idx))).all()
                assert (tgt[idx[:-1]] == tok[idx[1:]]).all()  # the next token of the same segment
                assert (m[idx[:-1]] == 1).all() and m[idx[-1]] == 0  # never predicts the next segment


def test_segment_lengths_one_segment_is_the_row():
    assert segment_lengths(np.random.default_rng(0), 2048, 1, 64) == [2048]


def test_flops_match_the_published_ceiling_arithmetic():
    # shared/BENCHMARKS.md: ~3.1 GFLOP/token for Qwen3-0.6B LoRA r16 at 2048, ~32 for Qwen3-8B.
    q06 = step_flops(model_config("qwen3-0.6b"), mode="lora", tokens=2048, segment_lengths=[2048], rank=16)
    assert q06["per_token"] / 1e9 == pytest.approx(3.15, abs=0.01)
    q8 = step_flops(model_config("qwen3-8b"), mode="lora", tokens=2048, segment_lengths=[2048], rank=16)
    assert q8["per_token"] / 1e9 == pytest.approx(32.3, abs=0.1)
    full = step_flops(model_config("qwen3-0.6b"), mode="full", tokens=2048, segment_lengths=[2048])
    assert full["linear"] == pytest.approx(1.5 * q06["linear"])  # 6 vs 4 x params x tokens
    assert full["attention"] == q06["attention"]


def test_causal_pairs():
    assert causal_pairs([4]) == 10 and causal_pairs([4, 4]) == 20
    assert causal_pairs([5], window=2) == 1 + 2 * 4  # 1, 2, 2, 2, 2
    assert causal_pairs([5], window=5) == causal_pairs([5])


def test_shapes_are_the_hf_anchors_shapes():
    """benchmarks/anchors/hf_peft_baseline.py runs without surojax (a copy of the shared anchor), so it keeps its
    own SHAPES table: every shape it has must be ours to the letter (a ratio of two different models is no ratio)."""
    import ast

    def anchor_shapes(name):
        tree = ast.parse((ROOT / "benchmarks/anchors" / name).read_text())
        node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SHAPES")
        return eval(compile(ast.Expression(node.value), name, "eval"), {"dict": dict})

    anchor = anchor_shapes("hf_peft_baseline.py")
    assert anchor and all(SHAPES[name] == shape for name, shape in anchor.items())
    vlm = anchor_shapes("hf_vlm_peft_baseline.py")  # Qwen3VLConfig(**shape): the model_type is the class's
    assert set(vlm) == {"qwen3-vl-2b", "debug-vl"}
    assert all(SHAPES[name] == {"model_type": "qwen3_vl", **shape} for name, shape in vlm.items())


def test_bench_train_images_builds_the_trainers_image_batches(capsys):
    """--images SIDE: one image opens each row (vision start, (SIDE/16)^2/4 image tokens, vision end; the image
    tokens unsupervised), split into micro-batches by the Trainer's image path (ImageInputs, M-RoPE positions
    that stop counting along the image), and the step trains LoRA with the tower frozen."""
    from surojax.bench.image_rows import synthetic_image_rows
    from surojax.models.vision.inputs import VisionTokens
    from surojax.train.image_inputs import IMAGES_KEY, step_image_batch

    rng = np.random.default_rng(0)
    tokens = VisionTokens.from_config(model_config("debug-vl"))
    text, _ = synthetic_batch(rng, 2, 2, 64, 512, 1, 64)
    batch = step_image_batch(synthetic_image_rows(rng, text, tokens, 64, 503), tokens, 2)  # 4x4 patches: 4 tokens
    ids = batch["tokens"]
    assert ids.shape == (2, 2, 64) and (ids[..., 0] == 502).all() and (ids[..., 1:5] == 500).all()
    assert (ids[..., 5] == 503).all() and not np.isin(ids[..., 6:], (500, 501, 502)).any()
    assert (batch["loss_mask"][..., :5] == 0).all() and (batch["loss_mask"][..., 5:63] == 1).all()
    assert batch[IMAGES_KEY].pixel_values.shape[:2] == (2, 32)  # per micro-batch: 2 images of 16 patches
    rope = batch["rope_positions"][0, :, 0]  # [3, T] of row 0: the image's 2x2 merged grid, then text from 3
    assert rope[:, 1:5].tolist() == [[1, 1, 1, 1], [1, 1, 2, 2], [1, 2, 1, 2]] and rope[:, 5].tolist() == [3] * 3

    rc = main(["bench", "train", "--shape", "debug-vl", "--images", "64", "--segments", "1", "--batch", "2",
               "--seq", "64", "--steps", "1", "--repeats", "1", "--warmup", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["image_tokens_per_row"] == 4 and np.isfinite(out["loss"])
    # LoRA r16 on the 7 linears of 2 layers (D 64, KV 32, F 128): 16 x (128 + 96 + 96 + 128 + 3 x 192) x 2; the
    # tower (in params_total) not trained
    assert out["params_trainable"] == 32768 and out["params_total"] > 32768 + 200_000


def test_bench_full_fine_tune_refuses_before_building_when_the_plan_does_not_fit(monkeypatch):
    import pytest

    import surojax.offload.memory_plan as memory_plan
    from surojax.bench.train_bench import BenchConfig, build, memory_plan as bench_plan

    bc = BenchConfig(shape="qwen3-8b", mode="full", batch=1, seq=2048, lmhead_chunks=4, recompute="full",
                     offload_optimizer=True)
    assert 75 * 2**30 < bench_plan(bc).total < 90 * 2**30  # the in-place update: ~82 GiB (docs/memory.md)
    import surojax.train.build as build_module

    monkeypatch.setattr(build_module, "device_capacity", lambda: 60 * 2**30)  # what build_run reads
    with pytest.raises(memory_plan.MemoryPlanError, match="offload_master: true"):
        build(bc)  # an 8B would take minutes to build on the CPU: the refusal comes first
