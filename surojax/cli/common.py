"""What every CLI command shares: run it with user errors turned into a clean message, config arguments.

Exit codes: 0 done, 1 a user error (bad config, missing file: one red line each, no traceback),
2 bad usage (or a command module missing from a broken install), 130 interrupted. Anything else is a bug and keeps
its traceback.

A user error is a ConfigError or any exception whose class sets `is_user_error = True`; raise such a class
(or UsageError) for mistakes the user can fix, so that every command reports them the same way.
This module imports nothing heavy: `surojax --help` must stay fast.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from surojax.config import TrainConfig
    from surojax.config.stages import Stage

EXIT_USER_ERROR = 1
EXIT_NOT_IMPLEMENTED = 2


class UsageError(Exception):
    """A command-line argument that parses but cannot be used (e.g. a path that does not exist)."""

    is_user_error = True


def is_user_error(exc: BaseException) -> bool:
    return getattr(exc, "is_user_error", False) is True


def print_error(message: str) -> None:
    """Each line of `message` as one red `error: ...` line on stderr (never wrapped, no markup parsing)."""
    # lazy: rich only once an error is printed (cli/main.py imports this module for a fast `--help`)
    from rich.console import Console
    from rich.text import Text

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in str(message).splitlines() or [""]:
        console.print(Text("error: ", style="bold red") + Text(line, style="red"))


def run_guarded(fn: Callable[..., int | None], *args: Any, **kwargs: Any) -> int:
    """Call fn; return its exit code (None is 0). A user error prints cleanly and returns 1."""
    try:
        rc = fn(*args, **kwargs)
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    except Exception as e:
        if is_user_error(e):
            print_error(str(e))
            return EXIT_USER_ERROR
        raise
    return 0 if rc is None else int(rc)


def add_config_arguments(parser: argparse.ArgumentParser, *, flag: bool = False) -> None:
    """A config path (positional, or `--config FILE` with flag=True) and repeatable `--override key=value`."""
    if flag:
        parser.add_argument("--config", required=True, metavar="FILE", help="training YAML")
    else:
        parser.add_argument("config", metavar="CONFIG", help="training YAML")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="set a config key, e.g. learning_rate=1e-4 or datasets.0.path=data.jsonl (repeatable)")


def add_overwrite_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--overwrite`: the one way to let a command replace an output that exists (`what` names it)."""
    parser.add_argument("--overwrite", action="store_true", help=f"replace {what} if it exists (without it, "
                        "an existing output is an error)")


def refuse_existing(path: str | Path, flag: str = "--output") -> None:
    """UsageError when `path` exists and is not an empty folder: nothing is replaced without --overwrite."""
    p = Path(path).expanduser()
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise UsageError(f"{flag} {p}: exists and is not empty; pass --overwrite to replace it "
                         "(or choose another path)")


def load_config_args(args: argparse.Namespace, *, check_paths: bool = True) -> TrainConfig:
    """Load + validate the config named by add_config_arguments (and check the paths it points at)."""
    # lazy: cli/main.py imports this module for `--help`, which must not import pydantic or jax
    from surojax.config import check_paths as _check_paths
    from surojax.config import load_config

    cfg = load_config(args.config, args.override)
    if check_paths:
        _check_paths(cfg, source=args.config)
    return cfg


def print_summary(cfg: TrainConfig) -> None:
    # lazy: cli/main.py imports this module for `--help`, which must not import pydantic or jax
    from surojax.config import summarize

    print("\n".join(summarize(cfg)))


def existing_path(value: str, flag: str) -> Path:
    p = Path(value).expanduser()
    if not p.exists():
        raise UsageError(f"{flag}: {value!r} does not exist")
    return p


def positive_int(value: str) -> int:
    """argparse type: an int > 0."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {n})")
    return n


def non_negative_int(value: str) -> int:
    """argparse type: an int >= 0."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {n})")
    return n


def report_console() -> Console:
    """The console training reports on: stderr. When stderr is not a terminal (a log file, a pipe, CI) rich would
    wrap every line at 80 columns; there each line is printed whole (soft wrap) so a log keeps one record a line."""
    from rich.console import Console

    console = Console(stderr=True)
    console.soft_wrap = not console.is_terminal
    return console


# scripts/run.sh exports these: the path it was started by ($0, as the user typed it) and the config it passes
RUN_SCRIPT_ENV, RUN_SCRIPT_CONFIG_ENV = "SUROJAX_RUN_SCRIPT", "SUROJAX_RUN_SCRIPT_CONFIG"


def launcher(command: str | None) -> tuple[list[str], str | None]:
    """The words that start this command again from the user's own shell, where the venv need not be active, and
    the config those words already pass (None: none). `command`: the `surojax` subcommand, None for
    `python -m surojax.train`.

    - `python -m surojax.train` started by scripts/run.sh (it sets SUROJAX_RUN_SCRIPT): `bash <the script as the
      user called it>`, which passes its own config (SUROJAX_RUN_SCRIPT_CONFIG);
    - the `surojax` console script: `surojax COMMAND` when `surojax` on PATH is this one, else its absolute path;
    - `python -m ...`: this interpreter's absolute path (a bare `python` there may lack jax)."""
    script = os.environ.get(RUN_SCRIPT_ENV)
    if command is None:
        if script:
            return ["bash", script], os.environ.get(RUN_SCRIPT_CONFIG_ENV) or None
        return [sys.executable, "-m", "surojax.train"], None
    if Path(sys.argv[0]).name == "surojax":
        exe = os.path.abspath(sys.argv[0])
        on_path = shutil.which("surojax")
        return ["surojax" if on_path and os.path.abspath(on_path) == exe else exe, command], None
    return [sys.executable, "-m", "surojax.cli.main", command], None


def command_setting(words: list[str], config: str | None, overrides: list[str], key: str, value: Any, *,
                    config_flag: bool = False) -> str:
    """The shell command line that runs again with top-level `key` set to `value`: `words` (see `launcher`), the
    config unless None, the same overrides but those of `key` (never --overwrite), then `-o key=value`."""
    words = list(words)
    if config is not None:
        words += [*(["--config"] if config_flag else []), config]
    for o in overrides:
        if o.partition("=")[0].strip() != key:
            words += ["-o", o]
    return shlex.join([*words, "-o", f"{key}={value}"])


def resume_command_for(args: argparse.Namespace, *, config_flag: bool = False) -> str:
    """The command line that continues the interrupted run `args` (add_config_arguments' config and overrides)
    started, `-o resume_from_checkpoint=true` added (`command_setting`), from the user's shell (`launcher`); the
    config left out when the launcher passes it already (scripts/run.sh)."""
    words, given = launcher(None if config_flag else args.command)
    return command_setting(words, None if given == args.config else args.config, args.override,
                           "resume_from_checkpoint", "true", config_flag=config_flag)


NOISY_LOGGERS = ("absl", "jax._src", "orbax", "grain")  # warnings only, during a training command


@contextlib.contextmanager
def training_logs() -> Iterator[None]:
    """While a training command runs, log records at INFO and above go to stderr as their bare message (surojax's
    INFO lines, e.g. the Chinchilla budget; other libraries' warnings only); everything is restored afterwards
    (in-process callers such as tests keep their logging). Replaces a plain StreamHandler that `basicConfig()`
    put on the root logger, e.g. the one absl adds when importing orbax logs (absl.logging.log calls basicConfig()
    on a root without handlers), which printed `WARNING:name:` prefixes and hid the INFO lines."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.handlers[:] = [h for h in handlers if type(h) is not logging.StreamHandler] + [handler]
    root.setLevel(logging.INFO)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, old in levels.items():
            logging.getLogger(name).setLevel(old)


def train_from_args(args: argparse.Namespace, *, config_flag: bool = False,
                    select: Callable[[list[Stage]], list[Stage]] | None = None) -> int:
    """Load + check the config, then run the trainer to the end (sft, pt and `python -m surojax.train`).

    A config with a `stages:` list runs its stages in order, all validated first (surojax/config/stages.py).
    `args.overwrite` (add_overwrite_argument) lets the run replace what an earlier run left in its output_dir.
    SIGINT / SIGTERM stop it after the current step with a checkpoint (surojax/train/interrupts.py); the exit
    code is then 130 / 143 and the command that resumes it is printed (`launcher`: runnable from the user's shell;
    `config_flag`: `python -m surojax.train`, which takes `--config FILE`, else `surojax COMMAND FILE`).
    `select`: the stages this command trains, of the validated ones (`surojax pt`: the pretraining stages)."""
    from surojax.config.stages import load_run
    from surojax.parallel.distributed import initialize_from_env
    from surojax.train.interrupts import Interrupts
    from surojax.train.stages import run_stages
    from surojax.train.xla_options import apply_xla_options

    with training_logs():
        stages = load_run(args.config, args.override, overwrite=args.overwrite)
        if select is not None:
            stages = select(stages)
        apply_xla_options(s.config for s in stages)  # XLA_FLAGS: before anything starts JAX's backend
        process = initialize_from_env()  # multi-process (surojax launch, srun); the others print warnings only
        resume = resume_command_for(args, config_flag=config_flag)
        with Interrupts() as interrupts:
            console = report_console()
            console.quiet = not process.is_main
            run_stages(stages, console=console, interrupts=interrupts, resume_command=resume)
    return interrupts.exit_code or 0
