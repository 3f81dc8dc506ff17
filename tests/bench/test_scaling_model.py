"""The scaling model on paper: its byte counts against hand arithmetic on the `debug` shape, the no-communication
limit, and the CLI's table. Pure arithmetic, no devices."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))  # the tools

from surojax.bench.shapes import model_config  # noqa: E402
from scaling_model import (  # noqa: E402
    Hardware,
    MeshPlan,
    Workload,
    bubble_fraction,
    comm_bytes,
    crosses_nodes,
    main,
    predict,
)

# The `debug` shape (surojax/bench/shapes.py) by hand: D 64, F 128, L 2, N 4 x H 16 = 64, K 2 x H 16 = 32,
# vocabulary 512 tied, qk-norm. Per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12,288; qk norms 2*16;
# MLP 3*64*128 = 24,576; two RMSNorms 2*64 -> 37,024. Two layers 74,048 + embedding 512*64 = 32,768 + final norm
# 64 = 106,880 parameters.
DEBUG_PARAMS = 106_880


def test_volumes_match_hand_arithmetic():
    cfg = model_config("debug")
    assert cfg.num_params() == DEBUG_PARAMS
    work = Workload(tokens_per_gpu=256, seq_len=128)
    # data parallelism over 4: ring all-reduce of fp32 gradients, 2 * 3/4 * 106,880 * 4 bytes
    assert comm_bytes(cfg, MeshPlan(data=4), work)["data"]["hidden"] == pytest.approx(641_280)
    # fsdp over 8: all-gather bf16 twice (7/8 * 106,880 * 2 each) + reduce-scatter fp32 (7/8 * 106,880 * 4)
    assert comm_bytes(cfg, MeshPlan(fsdp=8), work)["fsdp"]["hidden"] == pytest.approx(374_080 + 374_080)
    # data 2 x fsdp 4: the data all-reduce moves the fsdp shard, 2 * 1/2 * 106,880/4 * 4
    both = comm_bytes(cfg, MeshPlan(data=2, fsdp=4), work)
    assert both["data"]["hidden"] == pytest.approx(106_880)
    # tensor 2: (4 per layer * 2 layers + 2) all-reduces of [X, D] bf16, X = 256 * 2 tokens: 10 * 2*(1/2) * 512*64*2
    assert comm_bytes(cfg, MeshPlan(tensor=2), work)["tensor"]["exposed"] == pytest.approx(655_360)
    # expert 8 on debug-moe (D 64, 2 MoE layers): per layer forward (8-1) * 256 * 64 * (2 + 4) bytes, and backward
    moe = comm_bytes(model_config("debug-moe"), MeshPlan(expert=8), work)["expert"]["exposed"]
    assert moe == pytest.approx(2 * 2 * 7 * 256 * 64 * 6)
    # placement: fsdp inside the node of 8 GPUs, data across nodes
    assert not crosses_nodes(MeshPlan(data=2, fsdp=8), "fsdp", 8)
    assert crosses_nodes(MeshPlan(data=2, fsdp=8), "data", 8)
    assert bubble_fraction(MeshPlan(stage=4, microbatches=8, repeats=2)) == pytest.approx(3 / 19)


def test_one_gpu_without_communication_is_compute_bound():
    cfg = model_config("debug")
    hw, work = Hardware(gpus_per_node=1, peak_flops=1e12), Workload(tokens_per_gpu=256, seq_len=128, mfu=0.5)
    p = predict(cfg, MeshPlan(), nodes=1, hw=hw, work=work)
    assert p.comm_intra_s == p.comm_inter_s == 0
    assert p.efficiency == 1.0 and p.step_s == p.compute_s
    assert p.tokens_per_s == pytest.approx(256 / p.step_s)


def test_cli_prints_the_table(capsys):
    main(["--model", "qwen3-8b", "--nodes", "1", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["nodes", "mesh", "state"]
    assert out[2].split()[:2] == ["1", "f8"] and out[3].split()[:3] == ["2", "d2", "f8"]
