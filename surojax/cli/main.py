"""`surojax COMMAND ...`: the console script. Each command is a module surojax/cli/<command>.py (or a module it
shares with another command: `SHARED_MODULES`) with `add_arguments(parser)` and `run(args) -> int`, imported only
when that command runs (so `--help` is fast and never imports jax)."""
from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from surojax.cli.common import EXIT_NOT_IMPLEMENTED, print_error, run_guarded

# name -> one-line help; the module is command_module(name). Every command listed here is built
# (tests/cli/test_help.py runs each one's --help and reads its module); a line says what the command does, never
# that it is missing.
COMMANDS: dict[str, str] = {
    "sft": "supervised fine-tuning (full, LoRA, QLoRA) from a training YAML",
    "pt": "pretraining / continued pretraining from a training YAML",
    "dpo": "preference optimisation (DPO) on chosen / rejected pairs from a training YAML (full, LoRA, QLoRA)",
    "grpo": "reinforcement learning with GRPO (rollouts on the serving engine) from a training YAML",
    "grpo-colocate": "Surogate's three-file GRPO form (--train T --infer I --orch O), merged and run as `surojax grpo`",
    "distill": "knowledge distillation from a teacher (online, or --precompute its top-K log-probs once)",
    "tokenize": "tokenize and pack the datasets of a training YAML (--debug shows rows and loss masks)",
    "merge": "merge LoRA adapters into a base model",
    "export": "write a training run's checkpoint as a PEFT adapter (LoRA) or an HF safetensors folder (full)",
    "quantize": "write a model as a llama.cpp GGUF file (q4_k_m, q8_0, f16, ... file types)",
    "generate": "generate text on the command line from an HF folder, .gguf file, run, PEFT adapter or Hub id",
    "serve": "serve a model over an OpenAI-compatible HTTP API",
    "bench": "measure training throughput, memory and MFU (`bench train --shape ...`)",
    "launch": "start the processes of a multi-process run (one per GPU) on this node: launch --nproc-per-node N -- sft ...",
}


def _version() -> str:
    try:
        return version("surojax")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"surojax {_version()}")
        parser.exit()


# commands that share a module (their difference is a parameter the module reads from `args.command`)
SHARED_MODULES: dict[str, str] = {"sft": "train_command", "pt": "train_command"}


def command_module(name: str) -> str:
    """The module that implements command `name`: surojax.cli.<name> (a hyphen spelled _) or a shared one."""
    return f"surojax.cli.{SHARED_MODULES.get(name, name.replace('-', '_'))}"


def load_command(name: str) -> ModuleType:
    return importlib.import_module(command_module(name))


def build_parser(command: str | None = None, module: ModuleType | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only `command`'s own arguments are added (from `module`)."""
    parser = argparse.ArgumentParser(
        prog="surojax", description="Pretrain, fine-tune, align and serve LLMs with JAX.",
        epilog="Run `surojax COMMAND --help` for a command's options.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command and module is not None:
            module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    module = None
    if command in COMMANDS:
        try:
            module = load_command(command)
        except ModuleNotFoundError as e:
            if e.name != command_module(command):
                raise
            print_error(f"surojax {command} is not available in this version")
            return EXIT_NOT_IMPLEMENTED
    parser = build_parser(command, module)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if module is None:
        parser.print_help(sys.stderr)
        return 2
    return run_guarded(module.run, args)


if __name__ == "__main__":
    sys.exit(main())
