"""`surojax grpo-colocate --train T --infer I --orch O`: Surogate's three-file GRPO form, run as `surojax grpo`.

The three files are merged into surojax's one-YAML GRPO config (surojax/config/grpo_colocate.py says which keys
map); `-o KEY=VALUE` overrides apply to the merged config. The result is validated whole, written to
<output_dir>/grpo_colocate.yaml and trained as `surojax grpo <that file>` (the command printed, and the one an
interrupted run resumes with). A key that does not apply is refused, with the one-YAML command to use instead.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from surojax.cli.common import UsageError, add_overwrite_argument
from surojax.cli.grpo import run as run_grpo

ONE_YAML = ("the one-YAML form: put the GRPO keys in one training config (trainer: grpo, datasets of type: prompt, "
            "reward_functions, num_generations, max_completion_length; configs/grpo_arithmetic.yaml has one) and run "
            "`surojax grpo CONFIG`")


class ColocateError(UsageError):
    """Problems of the three files, each file's lines prefixed with its path, then the one-YAML hint."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train", required=True, metavar="FILE", help="trainer config YAML (a training config)")
    parser.add_argument("--infer", required=True, metavar="FILE", help="inference server config YAML (Surogate's)")
    parser.add_argument("--orch", required=True, metavar="FILE", help="orchestrator config YAML (Surogate's)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="set a key of the merged config, e.g. learning_rate=1e-4 (repeatable)")
    add_overwrite_argument(parser, "what an earlier run wrote in the output_dir")


def merged_config_file(args: argparse.Namespace) -> Path:
    """Merge, override and validate the three files; write the one-YAML config and return its path."""
    # lazy: `surojax COMMAND --help` never imports pydantic or jax (cli/main.py)
    import yaml

    from surojax.config.errors import ConfigError
    from surojax.config.grpo_colocate import merge_colocate
    from surojax.config.load import apply_overrides, config_from_dict, parse_override, read_config_file

    files = {"train": args.train, "infer": args.infer, "orch": args.orch}
    parsed = {role: read_config_file(path) for role, path in files.items()}
    merged = merge_colocate(*(parsed[r][0] for r in files), {r: parsed[r][1] for r in files})
    lines = [str(ConfigError(problems, files[role])) for role, problems in merged.problems.items() if problems]
    data = apply_overrides(merged.data, args.override)
    set_by = [parse_override(o)[0] for o in args.override]  # train.yaml's lines, but not of what -o replaced
    positions = {k: v for k, v in (parsed["train"][1] or {}).items() if not any(k[:len(o)] == o for o in set_by)}
    try:
        cfg = config_from_dict(data, f"{args.train} (merged with {args.infer} and {args.orch})", positions)
    except ConfigError as e:
        lines.append(str(e))
        cfg = None
    if lines:
        raise ColocateError("\n".join([*lines, f"grpo-colocate: {ONE_YAML}"]))
    out = Path(cfg.output_dir) / "grpo_colocate.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# written by surojax grpo-colocate from --train {args.train} --infer {args.infer} --orch {args.orch}"
              + "".join(f" -o {o}" for o in args.override) + "\n")
    out.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return out


def run(args: argparse.Namespace) -> int:
    config = merged_config_file(args)
    print(f"grpo-colocate: the one-YAML form of this run is {config}; running `surojax grpo {config}`",
          file=sys.stderr)
    one_yaml = argparse.Namespace(command="grpo", config=str(config), override=[], overwrite=args.overwrite)
    return run_grpo(one_yaml)
