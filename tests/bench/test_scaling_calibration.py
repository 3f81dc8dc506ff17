"""The scaling model's calibration from campaign rows: rows the model itself produced with a known mfu and overlap
give those inputs back; bad rows are named. Pure arithmetic, no devices."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))  # the tools

from surojax.bench.flops import PEAK_BF16_FLOPS  # noqa: E402
from scaling_calibration import calibrate, main, row_spec  # noqa: E402
from scaling_model import Hardware, MeshPlan, Workload, flops_per_token, predict  # noqa: E402
from surojax.bench.shapes import model_config  # noqa: E402

SEQ, BATCH = 2048, 2  # the campaign's dp-full rows: --batch 2 per data shard, seq 2048


def _row(part, name, gpus, mode, mesh, step_s, zero=None, shape="qwen3-8b"):
    cmd = f"bench train --shape {shape} --mode {mode} --batch {BATCH} --seq {SEQ} --recompute full"
    if zero is not None:
        cmd += f" --zero-stage {zero} --parallel data={gpus}"
    return {"bench": "multi_gpu", "part": part, "row": name, "gpus": gpus, "command": cmd, "step_ms": step_s * 1e3,
            "tokens_per_s": BATCH * gpus * SEQ / step_s, "mesh": mesh, "rows": BATCH * gpus}


def _model_step(plan, gpus, mfu, overlap, hw=Hardware()):
    work = Workload(seq_len=SEQ, tokens_per_gpu=BATCH * SEQ, mfu=mfu, overlap=overlap)
    return predict(model_config("qwen3-8b"), plan, 1, dataclasses.replace(hw, gpus_per_node=gpus), work).step_s


def test_rows_made_by_the_model_give_back_its_inputs():
    mfu, overlap = 0.55, 0.4
    rows = [_row("dp-full", "1 GPU (layerwise update)", 1, "full", {}, _model_step(MeshPlan(), 1, mfu, overlap)),
            _row("dp-full", "zero 1 (data=4)", 4, "full", {"data": 4},
                 _model_step(MeshPlan(data=4), 4, mfu, overlap), zero=1),
            _row("dp-full", "zero 3 (fsdp=4)", 4, "full", {"fsdp": 4},
                 _model_step(MeshPlan(fsdp=4, zero_stage=3), 4, mfu, overlap), zero=3),
            _row("dp-lora", "data=4", 4, "lora", {"data": 4}, 0.5),
            {"bench": "multi_gpu", "part": "dp-full", "row": "zero 3 (fsdp=8)", "gpus": 8, "error": "OOM"}]
    cal = calibrate(rows)
    assert cal.mfu["dense"] == pytest.approx(mfu, rel=1e-9)
    assert cal.overlap == pytest.approx(overlap, rel=1e-9)
    assert cal.fitted == ("mfu dense", "overlap")  # no ep row: the MoE mfu keeps its default
    by_name = {r.spec.name: r for r in cal.rows}
    for name in ("zero 1 (data=4)", "zero 3 (fsdp=4)"):  # the calibrated model reproduces the rows it was fit on
        assert by_name[name].model_step_s == pytest.approx(by_name[name].spec.step_s, rel=1e-9)
    assert by_name["data=4"].used_for == "" and "LoRA" in by_name["data=4"].note
    assert len(cal.skipped) == 1 and "zero 3 (fsdp=8)" in cal.skipped[0] and "OOM" in cal.skipped[0]


def test_the_dense_mfu_is_the_rows_flops_over_its_time():
    # one Qwen3-8B row of 4096 tokens in 1 s at 731 TFLOP/s: mfu = 4096 x FLOPs/token / 731e12
    row = _row("dp-full", "1 GPU", 1, "full", {}, 1.0)
    spec = row_spec(row)
    assert spec.tokens_per_gpu == BATCH * SEQ
    assert calibrate([row]).mfu["dense"] == pytest.approx(
        BATCH * SEQ * flops_per_token(model_config("qwen3-8b"), SEQ) / PEAK_BF16_FLOPS)


def test_a_row_whose_mesh_does_not_match_its_gpus_is_named():
    row = _row("dp-full", "zero 1 (data=2)", 2, "full", {"data": 4}, 1.0, zero=1)
    with pytest.raises(ValueError, match=r"dp-full/zero 1 \(data=2\).*4 devices.*2"):
        row_spec(row)


def test_cli_prints_the_fit_and_calibrated_tables(tmp_path, capsys):
    rows = [_row("dp-full", "1 GPU", 1, "full", {}, 0.9),
            _row("dp-full", "zero 3 (fsdp=2)", 2, "full", {"fsdp": 2}, 0.95, zero=3)]
    path = tmp_path / "multi_gpu.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    main([str(path), "--model", "qwen3-8b", "--nodes", "1", "2"])
    out = capsys.readouterr().out
    assert "| dp-full | zero 3 (fsdp=2) | 2 |" in out
    assert "qwen3-8b (calibrated: mfu dense, overlap from measured rows" in out
