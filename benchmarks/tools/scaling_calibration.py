"""Calibrate the scaling model (scaling_model.py) from measured multi-GPU rows, then print its predictions.

    python benchmarks/tools/scaling_calibration.py multi_gpu.jsonl [--nvlink-gbs 360] [--nodes 1 2 4 ...]

The rows are benchmarks/campaigns/multi_gpu_h200.py's JSON lines (`surojax bench train` steps of one job: a 1-GPU row and its
N-GPU rows per part). Two inputs of the model are fitted, the rest keep their defaults (docs/multi_gpu.md):

    mfu       per kind, from the 1-GPU row of one part: dense from `dp-full` (Qwen3-8B full fine-tuning), MoE from
              `ep` (Qwen3-30B-A3B LoRA, the kind's convention since session 6): the row's FLOPs in the model's
              count (one segment per row; the bench's MFU counts its packed segments' attention, so the two
              differ a little) / (peak x its measured step). The model then reproduces the full fine-tuning row's
              step exactly.
    overlap   from the N-GPU full fine-tuning rows (`dp-full`: ZeRO-1 over data, ZeRO-3 over fsdp) of the same
              tokens per GPU. The model's step there is compute + exposed + hidden - overlap x hidden (while that
              stays above compute), with compute from the fitted mfu and hidden / exposed the row's collective bytes
              over the link bandwidth (--nvlink-gbs: nominal unless nccl-tests' bus bandwidth is given). Solved for
              overlap, clipped to [0, 1]; the rows' mean is the model's. It lumps every difference between the
              N-GPU and the 1-GPU step into communication (a slower optimizer path, launch gaps), which is what
              the model can carry.

Rows the model cannot read are listed with why: LoRA rows (the model counts full training's gradients), expert
rows (the model's token exchange is calibrated by their profile, not by a step), pipeline rows (their bubble is
compared in the campaign itself: measured vs predicted), the launch rows (losses).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from scaling_model import (DEFAULT_MFU, MODELS, NODES, Hardware, MeshPlan, Workload,  # benchmarks/tools/: first,
                           add_hardware_args, hardware, predict, tables)  # it puts the repository root on sys.path

from surojax.bench.flops import flop_targets, step_flops  # noqa: E402
from surojax.bench.shapes import SHAPES, model_config  # noqa: E402

MFU_PART = {"dense": "dp-full", "moe": "ep"}  # the part whose 1-GPU row gives the kind's mfu
OVERLAP_PART = "dp-full"
WHY_NOT = {"ep": "the token exchange is calibrated by a profile, not a step",
           "pp": "its bubble is compared in the campaign (measured vs predicted)"}


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """What the model needs of one measured row."""
    part: str
    name: str
    shape: str
    mode: str
    seq: int
    gpus: int
    plan: MeshPlan
    tokens_per_gpu: int
    step_s: float
    rank: int = 16  # LoRA rows: the bench's --rank (its default)


def row_spec(row: dict) -> RowSpec:
    """A campaign row -> RowSpec: shape / mode / seq / zero stage from its `bench train` command, the mesh and the
    rows per micro-batch (over the mesh) from its result. Raises ValueError naming the row when a field is missing."""
    name = f"{row.get('part')}/{row.get('row')}"
    if row.get("error") or not row.get("step_ms"):
        raise ValueError(f"row {name}: no step time ({(row.get('error') or 'missing step_ms')[:80]})")
    argv = shlex.split(row.get("command", ""))
    opts = {}
    for i, tok in enumerate(argv[:-1]):
        if tok.startswith("--"):
            opts[tok[2:]] = argv[i + 1]
    missing = [f"--{k}" for k in ("shape", "mode", "seq") if k not in opts] + ["rows"] * ("rows" not in row)
    if missing:
        raise ValueError(f"row {name}: its command / result lacks {', '.join(missing)}")
    axes = {a: int(n) for a, n in (row.get("mesh") or {}).items()}
    extra = set(axes) - {f.name for f in dataclasses.fields(MeshPlan)}
    if extra:
        raise ValueError(f"row {name}: mesh axes {sorted(extra)} are not the model's")
    plan = MeshPlan(**axes, zero_stage=int(opts.get("zero-stage", 1)))
    gpus = int(row["gpus"])
    if plan.devices != gpus:
        raise ValueError(f"row {name}: mesh {axes} has {plan.devices} devices, the row ran on {gpus}")
    seq = int(opts["seq"])
    return RowSpec(part=row["part"], name=row["row"], shape=opts["shape"], mode=opts["mode"], seq=seq, gpus=gpus,
                   plan=plan, tokens_per_gpu=int(row["rows"]) * seq // gpus, step_s=row["step_ms"] / 1e3,
                   rank=int(opts.get("rank", 16)))


@dataclasses.dataclass(frozen=True)
class RowFit:
    spec: RowSpec
    used_for: str  # "mfu" | "overlap" | "" (reported only)
    value: float | None  # the fitted input this row gives
    model_step_s: float | None  # the calibrated model's step for this row
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Calibration:
    mfu: dict[str, float]  # per kind ("dense", "moe"), DEFAULT_MFU where no row gave one
    overlap: float
    fitted: tuple[str, ...]  # which inputs came from rows
    rows: tuple[RowFit, ...]
    skipped: tuple[str, ...] = ()  # rows that could not be read, and why

    def workload(self, kind: str, base: Workload = Workload()) -> Workload:
        return dataclasses.replace(base, mfu=self.mfu[kind], overlap=self.overlap)

    def label(self) -> str:
        fitted = ", ".join(self.fitted) or "nothing"
        return (f"calibrated: {fitted} from measured rows; mfu dense {self.mfu['dense']:.3g}, moe "
                f"{self.mfu['moe']:.3g}, overlap {self.overlap:.2f}")


def _kind(shape: str) -> str:
    return "moe" if model_config(shape).moe is not None else "dense"


def _row_hw(spec: RowSpec, hw: Hardware) -> Hardware:
    """One host: every GPU of the row on NVLink."""
    return dataclasses.replace(hw, gpus_per_node=spec.gpus)


def _row_work(spec: RowSpec, mfu: float, overlap: float) -> Workload:
    return Workload(seq_len=spec.seq, tokens_per_gpu=spec.tokens_per_gpu, mfu=mfu, overlap=overlap)


def fit_mfu(spec: RowSpec, hw: Hardware) -> float:
    """The row's FLOPs (its own mode: LoRA counts the frozen base's forward and input gradient plus the adapters,
    flops.py; one segment of seq per row, as the model counts) / (peak x its measured step time). For a full
    fine-tuning row the model's 1-GPU step then takes exactly the measured time; a LoRA row's mfu is applied to
    full training's FLOPs, the model's convention for MoE (DEFAULT_MFU)."""
    cfg = model_config(spec.shape)
    flops = step_flops(cfg, mode=spec.mode, tokens=spec.tokens_per_gpu, segment_lengths=[spec.seq] * max(
        spec.tokens_per_gpu // spec.seq, 1), rank=spec.rank, targets=flop_targets(cfg, "all-linear"))["total"]
    return flops / (hw.peak_flops * spec.step_s)


def fit_overlap(spec: RowSpec, mfu: float, hw: Hardware) -> tuple[float, str]:
    """(overlap, note) from one N-GPU row: step = compute + exposed + (1 - overlap) x hidden."""
    cfg = model_config(spec.shape)
    p = predict(cfg, spec.plan, 1, _row_hw(spec, hw), _row_work(spec, mfu, overlap=0.0))
    if p.hidden_s <= 0:
        return 1.0, "no hideable collectives"
    raw = (p.compute_s + p.exposed_s + p.hidden_s - spec.step_s) / p.hidden_s
    note = ""
    if raw > 1:
        note = "faster than compute + exposed: clipped to 1"
    elif raw < 0:
        note = "slower than every collective exposed: clipped to 0"
    value = min(max(raw, 0.0), 1.0)
    if value * p.hidden_s > p.compute_s:  # the model then hides compute's worth only: the step says nothing more
        note = (note + "; " if note else "") + "hidden collectives exceed compute: a lower bound"
    return value, note


def calibrate(rows: Iterable[dict], hw: Hardware = Hardware()) -> Calibration:
    """Fit mfu (per kind) and overlap from the campaign's rows (module docstring)."""
    specs, skipped = [], []
    for row in rows:
        if row.get("bench") != "multi_gpu" or row.get("part") == "launch":
            continue
        try:
            specs.append(row_spec(row))
        except ValueError as e:
            skipped.append(str(e))
    mfu, fitted = dict(DEFAULT_MFU), []
    for kind, part in MFU_PART.items():
        one = next((s for s in specs if s.part == part and s.gpus == 1), None)
        if one is not None:
            mfu[kind] = fit_mfu(one, hw)
            fitted.append(f"mfu {kind}")
    overlaps = {id(s): fit_overlap(s, mfu[_kind(s.shape)], hw) for s in specs
                if s.gpus > 1 and s.part == OVERLAP_PART and s.mode == "full"}  # id -> (overlap, note)
    overlap = statistics.fmean(v for v, _ in overlaps.values()) if overlaps else Workload.overlap
    if overlaps:
        fitted.append("overlap")
    return Calibration(mfu=mfu, overlap=overlap, fitted=tuple(fitted), skipped=tuple(skipped),
                       rows=tuple(_row_fit(s, mfu, overlap, overlaps.get(id(s)), hw) for s in specs))


def _row_fit(s: RowSpec, mfu: dict[str, float], overlap: float, fitted_overlap, hw: Hardware) -> RowFit:
    """What one row gave the fit (its input and note, or why none) and the calibrated model's step for it."""
    model = None  # the model's step only where it counts the row's work (full training)
    if s.mode == "full":
        model = predict(model_config(s.shape), s.plan, 1, _row_hw(s, hw),
                        _row_work(s, mfu[_kind(s.shape)], overlap)).step_s
    if fitted_overlap is not None:
        return RowFit(s, "overlap", fitted_overlap[0], model, fitted_overlap[1])
    if s.gpus == 1:
        if s.part in MFU_PART.values():
            return RowFit(s, "mfu", mfu[_kind(s.shape)], model)
        return RowFit(s, "", None, model, f"part {s.part}: the 1-GPU anchor of its scaling")
    why = WHY_NOT.get(s.part) or ("LoRA: the model counts full training's gradients" if s.mode == "lora"
                                  else "not an input of the model")
    return RowFit(s, "", None, model, why)


def format_fit(cal: Calibration) -> str:
    lines = ["| part | row | GPUs | measured step ms | model step ms | fits | value | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in cal.rows:
        s = r.spec
        model = f"{r.model_step_s * 1e3:.1f}" if r.model_step_s is not None else "-"
        value = f"{r.value:.3g}" if r.value is not None else "-"
        lines.append(f"| {s.part} | {s.name} | {s.gpus} | {s.step_s * 1e3:.1f} | {model} | {r.used_for or '-'} | "
                     f"{value} | {r.note} |")
    lines += [f"| - | {why} | | | | | | skipped |" for why in cal.skipped]
    return "\n".join(lines)


def read_rows(path: str | Path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/tools/scaling_calibration.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("rows", help="benchmarks/campaigns/multi_gpu_h200.py's JSON lines ($OUT/multi_gpu.jsonl)")
    ap.add_argument("--model", action="append", choices=sorted(SHAPES), help=f"default: {', '.join(MODELS)}")
    ap.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    ap.add_argument("--seq", type=int, default=Workload.seq_len)
    ap.add_argument("--tokens-per-gpu", type=int, default=Workload.tokens_per_gpu)
    add_hardware_args(ap)
    args = ap.parse_args(argv)
    hw = hardware(args)
    cal = calibrate(read_rows(args.rows), hw)
    print(format_fit(cal))
    print()
    base = Workload(seq_len=args.seq, tokens_per_gpu=args.tokens_per_gpu)
    print(tables(args.model or MODELS, args.nodes, hw,
                 lambda cfg: cal.workload("moe" if cfg.moe is not None else "dense", base), label=cal.label()))


if __name__ == "__main__":
    main()
