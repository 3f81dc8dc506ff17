"""Run the stages of a config in order: each one a full Trainer run, with the generation eval around it.

    from surojax.config import load_run                 # a staged YAML -> its stages; a plain one -> one stage
    from surojax.train.stages import run_stages
    results = run_stages(load_run("configs/quickstart.yaml"))
    results[-1].generation_eval["after"]["accuracy"]

`python -m surojax.train --config FILE` (and `surojax sft|pt FILE`) do exactly this. Every stage has been
validated (config and paths) before the first one starts; see surojax/config/stages.py for the YAML.
A stage with `eval_generation` answers the held-out prompts greedily before training (the model as loaded:
a LoRA stage's fresh adapters are zero, so that is the base) and after it (`trainer.trained_model()`), prints
"accuracy before -> after" with a few samples, and writes both to `<output_dir>/generation_eval.json`. The
before figures are written there as soon as they are measured: a stage resumed from a checkpoint reuses them
(its weights are no longer the ones before training, so they are never measured again).

Nothing an earlier run wrote is replaced unless the stage has `overwrite_output_dir` (`--overwrite`): a stage that
an earlier run finished (`Stage.is_complete`: all its exports exist) is skipped with a line saying so, and its
saved results (last metrics.jsonl rows, generation_eval.json) go into the report, so re-running a finished
multi-stage config (the quickstart) only reports it.

SIGINT / SIGTERM (train/interrupts.py, installed once for the whole run) stop the run after the current step of
the running stage (which saves a checkpoint there) or, between stages, before the next stage; the run prints the
command that resumes it, and `interrupts.exit_code` (130 / 143) is the process's exit status.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from surojax.config.stages import OUTPUT_ARTIFACTS, Stage
from surojax.parallel.distributed import barrier, is_main_process
from surojax.train.generation_eval import GenerationEval, GenerationEvalResult, report, save_before, saved_before
from surojax.train.interrupts import Interrupts
from surojax.train.trainers import make_trainer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StageResult:
    name: str | None
    output_dir: Path
    metrics: dict  # the last logged train metrics (+ eval_loss), as Trainer.train returns them
    seconds: float
    generation_eval: dict | None = None  # {"dataset", "before", "after"} as in generation_eval.json
    skipped: bool = False  # finished by an earlier run: nothing trained, results read from its output_dir
    interrupted: bool = False  # stopped by SIGINT / SIGTERM (a checkpoint at the last step, no export)


def clear_output_dir(output_dir: str | Path) -> list[Path]:
    """Delete what a finished or broken earlier run left in `output_dir` (OUTPUT_ARTIFACTS only)."""
    root = Path(output_dir)
    removed = []
    for name in OUTPUT_ARTIFACTS:
        p = root / name
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            continue
        removed.append(p)
    return removed


def finished_result(stage: Stage) -> StageResult:
    """What an earlier run of a complete stage left: its last train metrics (+ eval_loss) from metrics.jsonl
    and its generation_eval.json."""
    out = Path(stage.config.output_dir)
    metrics: dict = {}
    if (out / "metrics.jsonl").is_file():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            metrics.update({k: v for k, v in row.items() if k != "step"})
    ev = out / "generation_eval.json"
    return StageResult(stage.name, out, metrics, 0.0, json.loads(ev.read_text()) if ev.is_file() else None,
                       skipped=True)


def run_stage(stage: Stage, *, console=None, interrupts: Interrupts | None = None) -> StageResult:
    """One stage: (clear its output_dir) -> Trainer -> generation eval before -> train -> eval after.
    A complete stage of a multi-stage config without overwrite_output_dir is not run: `finished_result(stage)`
    (a plain config's Trainer refuses a finished output_dir instead)."""
    cfg = stage.config
    t0 = time.perf_counter()
    interrupts = interrupts or Interrupts()  # (not entered: a flag nobody sets)
    if stage.index is not None and not stage.overwrite_output_dir and stage.is_complete():
        done = ", ".join(str(p) for p in stage.outputs())
        message = (f"already complete: {done} (an earlier run); not trained again (pass --overwrite to train it "
                   "again, or choose another output_dir)")
        if console is None:
            log.info("%s", message)
        else:
            console.print(message, highlight=False, soft_wrap=True)
        return finished_result(stage)
    if stage.overwrite_output_dir:  # multi-process: process 0 removes, the others wait for it
        removed = clear_output_dir(cfg.output_dir) if is_main_process() else []
        barrier("overwrite_output_dir")
        if removed:
            log.info("overwrite_output_dir: removed %s", ", ".join(str(p) for p in removed))
    trainer = make_trainer(cfg, console=console)
    console = trainer.console
    evaluator = GenerationEval.from_config(cfg, trainer.tokenizer)
    before = None if evaluator is None else _before_training(evaluator, trainer, cfg.eval_generation.path, console)
    metrics = trainer.train(interrupts)
    if interrupts.requested:
        return StageResult(stage.name, trainer.output_dir, metrics, time.perf_counter() - t0, interrupted=True)
    summary = None
    if evaluator is not None:
        after = evaluator.run(trainer.trained_model())
        summary = report(before, after, path=trainer.output_dir / "generation_eval.json",
                         dataset=cfg.eval_generation.path, console=console)
    return StageResult(stage.name, trainer.output_dir, metrics, time.perf_counter() - t0, summary)


def _before_training(evaluator: GenerationEval, trainer, dataset: str, console) -> GenerationEvalResult | None:
    """The generation eval of the weights before training: measured on a run at step 0 (and saved to
    generation_eval.json at once); a run resumed from a checkpoint takes the figures its start saved there, or
    has none (it never measures its resumed weights as "before training")."""
    path = trainer.output_dir / "generation_eval.json"
    if trainer.step_count == 0:
        before = evaluator.run(trainer.trained_model())
        if is_main_process():
            save_before(path, before, dataset)
        where = ""
    else:
        before = saved_before(path, dataset, len(evaluator.examples))
        where = f" (measured at the start of the run, read from {path})"
    if before is None:
        console.print(f"generation eval before training: not available: the run resumed at step "
                      f"{trainer.step_count} and {path} holds no figures from its start", highlight=False)
    else:
        console.print(f"generation eval before training: {100 * before.accuracy:.1f}% exact match "
                      f"({before.correct}/{before.total}) on {dataset}{where}", highlight=False)
    return before


def run_stages(stages: Sequence[Stage], *, console=None, interrupts: Interrupts | None = None,
               resume_command: str | None = None) -> list[StageResult]:
    """Run the (already validated) stages in order; a multi-stage run ends with a table of all stages.

    `interrupts`: an entered Interrupts (installed here for the whole run when None); after a signal the run
    stops (module docstring) and prints `resume_command`, the command line that continues it."""
    if interrupts is None:
        with Interrupts() as own:
            return run_stages(stages, console=console, interrupts=own, resume_command=resume_command)
    console = console or Console(stderr=True)
    staged = any(s.index is not None for s in stages)
    t0 = time.perf_counter()
    results = []
    for n, stage in enumerate(stages, 1):
        if interrupts.requested:
            break
        if staged:
            console.rule(f"[bold]stage {n}/{len(stages)}: {stage.name}[/]")
        results.append(run_stage(stage, console=console, interrupts=interrupts))
        if staged and not results[-1].skipped and not results[-1].interrupted:
            console.print(f"stage {stage.name} finished in {_duration(results[-1].seconds)}", highlight=False)
    if interrupts.requested:
        where = f" in stage {results[-1].name}" if staged and results else ""
        console.print(f"[yellow]{interrupts.name}[/]: the run stopped{where}; to continue it run\n  "
                      + (resume_command or "the same command with resume_from_checkpoint: true in the config "
                         "(or -o resume_from_checkpoint=true)"), highlight=False, soft_wrap=True)
        return results
    if staged:
        _print_summary(results, time.perf_counter() - t0, console)
    return results


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m {s:02d}s" if m else f"{s}s"


def _print_summary(results: list[StageResult], seconds: float, console) -> None:
    table = Table(title=f"{len(results)} stages in {_duration(seconds)}")
    table.add_column("stage", no_wrap=True)
    table.add_column("output", overflow="fold")
    table.add_column("loss (eval)", no_wrap=True)
    table.add_column("generation eval", no_wrap=True)
    table.add_column("time", no_wrap=True)
    for r in results:
        m, ev = r.metrics or {}, r.generation_eval
        loss = f"{m['loss']:.4f}" if "loss" in m else "-"
        if "eval_loss" in m:
            loss += f" ({m['eval_loss']:.4f})"
        acc = "-"
        if ev is not None:
            after = f"{100 * ev['after']['accuracy']:.1f}%"
            acc = f"{100 * ev['before']['accuracy']:.1f}% -> {after}" if ev.get("before") else after
        table.add_row(r.name or "-", str(r.output_dir), loss, acc,
                      "earlier run" if r.skipped else _duration(r.seconds))
    console.print(table)
