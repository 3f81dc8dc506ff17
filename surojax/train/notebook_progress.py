"""The training progress bar in a Jupyter notebook: one output, updated in place.

On a terminal the trainer draws rich's live Progress bar; where stderr is a file or a pipe it prints a line per
logged step instead. In a notebook neither fits: rich draws a live display there only through ipywidgets (not a
dependency: without it every refresh warns), and a line per step is hundreds of outputs in the cell (the
quickstart's pretraining logged 408). So in a notebook (`console.is_jupyter`) the trainer uses `NotebookProgress`:
the same columns rendered as text into one display (IPython's display handle, which every Jupyter kernel has),
replaced at most every `interval` seconds and once more at the end. It offers the part of rich's Progress the
trainer uses: a context manager with `add_task`, `update` and `console`.

    with NotebookProgress(*columns, console=console) as progress:
        task = progress.add_task("train", total=400, loss=float("nan"))
        progress.update(task, completed=1, loss=2.3)
"""
from __future__ import annotations

import io
import time

from rich.console import Console
from rich.progress import Progress, ProgressColumn, TaskID


class NotebookProgress:
    """rich Progress columns shown as one notebook output that each update replaces (module docstring)."""

    def __init__(self, *columns: ProgressColumn, console: Console, interval: float = 0.5):
        self.console = console  # other lines (first step, evals) still print as their own outputs
        self.interval = interval
        self._progress = Progress(*columns, console=console, auto_refresh=False, disable=True)
        self._handle = None
        self._shown_at = 0.0

    def __enter__(self) -> NotebookProgress:
        return self

    def __exit__(self, *exc) -> None:
        self._show()

    def add_task(self, description: str, **kwargs) -> TaskID:
        task = self._progress.add_task(description, **kwargs)
        self._show()
        return task

    def update(self, task: TaskID, **kwargs) -> None:
        self._progress.update(task, **kwargs)
        if time.monotonic() - self._shown_at >= self.interval:
            self._show()

    def text(self) -> str:
        """The bar as plain text, as it is shown."""
        out = Console(file=io.StringIO(), width=self.console.width, color_system=None, force_terminal=False,
                      force_jupyter=False)
        out.print(self._progress.get_renderable())
        return out.file.getvalue().rstrip("\n")

    def _show(self) -> None:
        from IPython.display import display  # a notebook's kernel has IPython (only used there)

        data = {"text/plain": self.text()}
        if self._handle is None:
            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)
        self._shown_at = time.monotonic()
