"""Where training metrics go: JSONL (always), TensorBoard, Weights & Biases and Aim (when `report_to` lists
them), and a loss-curve PNG written at the end of the run.

metrics.jsonl is appended to only by the run that wrote it (a resume first drops the rows after its checkpoint,
`truncate_after`); a run that starts at step 0 where an earlier one left rows (it stopped before any whole
checkpoint: a crash, a second Ctrl-C) moves that file aside first (`set_aside`), never mixing two runs' steps."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from surojax.weights.atomic import write_text_atomic

log = logging.getLogger(__name__)


class MetricsSinkError(RuntimeError):
    is_user_error = True


class JsonlSink:
    """One JSON object per line, `{"step": s, ...metrics}`, appended (line-buffered: each row is one write)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "a", buffering=1)

    def write(self, step: int, metrics: dict) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop the rows of steps > `step` (a resumed run writes them again: no step appears twice).
        The kept rows are written to a temporary file that replaces the old one."""
        self.file.close()
        kept = [line for line in self.path.read_text().splitlines(keepends=True) if _row_step(line) <= step]
        write_text_atomic(self.path, "".join(kept))
        self.file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        self.file.close()


def set_aside(path: Path) -> tuple[Path, list[int]] | None:
    """Move `path` (a metrics.jsonl of an earlier run) to the first free `metrics.<n>.jsonl` beside it, when it
    holds rows; returns (where it went, the steps it holds). None (nothing moved) when it is missing or empty."""
    text = path.read_text() if path.is_file() else ""
    if not text.strip():
        return None
    steps = sorted({int(s) for s in map(_row_step, text.splitlines()) if math.isfinite(s)})
    n = 1
    while (moved := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.replace(path, moved)
    return moved, steps


def _row_step(line: str) -> float:
    """The step of a metrics.jsonl row; a torn last line (a killed process) counts as after every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class TensorBoardSink:
    def __init__(self, logdir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise MetricsSinkError("report_to lists tensorboard, but neither tensorboardX nor torch is "
                                       "installed: pip install tensorboardX") from None
        self.writer = SummaryWriter(str(logdir))

    def write(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, config: dict, run_dir: Path, name: str | None = None):
        try:
            import wandb
        except ImportError:
            raise MetricsSinkError("report_to lists wandb, but wandb is not installed: pip install wandb") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, config=config, dir=str(run_dir), name=name)

    def write(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class AimSink:
    """An Aim run (aimstack.io): the config as its hparams, each metric tracked by name and step."""

    def __init__(self, config: dict, name: str | None = None, experiment: str | None = None,
                 repo: str | None = None):
        try:
            from aim import Run
        except ImportError:
            raise MetricsSinkError("report_to lists aim, but aim is not installed: pip install aim") from None
        self.run = Run(repo=repo, experiment=experiment)
        if name is not None:
            self.run.name = name
        self.run["hparams"] = config

    def write(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            self.run.track(v, name=k, step=step)

    def close(self) -> None:
        self.run.close()


class Metrics:
    """Fan-out to the sinks; keeps the history for the final chart. `write=False` (the processes other than 0
    of a multi-process run): no sink is opened, only the history is kept."""

    def __init__(self, output_dir: Path, report_to=(), run_config: dict | None = None, project: str = "surojax",
                 *, write: bool = True, run_name: str | None = None, wandb_name: str | None = None,
                 aim_experiment: str | None = None, aim_repo: str | None = None, aim_name: str | None = None):
        self.output_dir = output_dir
        self.sinks = []
        self.history: list[dict] = []
        self.closed = False
        if not write:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.sinks.append(JsonlSink(output_dir / "metrics.jsonl"))
        for name in report_to or ():
            if name == "tensorboard":
                self.sinks.append(TensorBoardSink(output_dir / "tensorboard"))
            elif name == "wandb":
                self.sinks.append(WandbSink(project, run_config or {}, output_dir, wandb_name or run_name))
            elif name == "aim":
                self.sinks.append(AimSink(run_config or {}, aim_name or run_name, aim_experiment, aim_repo))
            elif name not in ("jsonl", "none"):
                raise MetricsSinkError(f"report_to: {name!r} is unknown (jsonl, tensorboard, wandb, aim)")

    def truncate_after(self, step: int) -> None:
        """Resuming at `step`: metrics.jsonl keeps only the rows up to it (TensorBoard / W&B handle repeats)."""
        for s in self.sinks:
            if isinstance(s, JsonlSink):
                s.truncate_after(step)

    def write(self, step: int, metrics: dict) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        self.history.append({"step": step, **metrics})
        for s in self.sinks:
            s.write(step, metrics)

    def close(self) -> None:
        """Close every sink (idempotent)."""
        if self.closed:
            return
        for s in self.sinks:
            s.close()
        self.closed = True


def plot_loss(history: list[dict], path: Path, title: str = "training loss") -> Path | None:
    """Loss (and eval loss when present) against the step, as a PNG. Returns None without data.

    Drawn on a Figure with its own Agg canvas, never through pyplot: the process's matplotlib backend (a notebook's
    inline one, a user's GUI one) and pyplot's figures are left as they were."""
    train = [(h["step"], h["loss"]) for h in history if "loss" in h and math.isfinite(h["loss"])]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if not train and not evals:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", lw=1.2, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / supervised token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path
