"""The `surojax` console script, the placeholder commands and `python -m surojax.train`."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from surojax.cli import common
from surojax.cli.main import COMMANDS, build_parser, load_command, main
from surojax.cli.train_script import main as train_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "examples" / "lora_qwen3.yaml"


def run_py(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "60", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def good_config(tmp_path: Path) -> Path:
    """A valid config whose paths exist."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hi"}\n')
    p = tmp_path / "good.yaml"
    p.write_text(f"model: {model}\ndatasets:\n  - path: {data}\n    type: text\nmax_steps: 10\n")
    return p


@pytest.fixture
def bad_config(tmp_path: Path) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text("model: m\ndatasets: [{path: a}]\nlearning_rat: 1e-4\n")
    return p


def test_help_lists_every_command_without_importing_jax():
    code = ("import sys; from surojax.cli.main import main; rc = main(['--help']); "
            "print('HEAVY', sorted(m for m in ('jax', 'pydantic', 'surojax.config') if m in sys.modules)); "
            "sys.exit(rc)")
    r = run_py("-c", code)
    assert r.returncode == 0, r.stderr
    for name in ("sft", "pt", "dpo", "grpo", "distill", "tokenize", "merge", "export", "quantize", "generate",
                 "serve", "bench"):
        assert f"    {name} " in r.stdout, name
    assert "HEAVY []" in r.stdout


def test_command_help_does_not_import_jax():
    code = ("import sys; from surojax.cli.main import main; rc = main(['sft', '--help']); "
            "print('JAX', 'jax' in sys.modules); sys.exit(rc)")
    r = run_py("-c", code)
    assert r.returncode == 0 and "--override" in r.stdout and "JAX False" in r.stdout


def test_help_as_module():
    r = run_py("-m", "surojax.cli.main", "--help")
    assert r.returncode == 0 and all(name in r.stdout for name in COMMANDS)


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "generate"])
def test_each_command_module_has_the_interface(name):
    module = load_command(name)  # a hyphenated command's module spells it _ (grpo-colocate: grpo_colocate)
    parser = build_parser(name, module)
    assert callable(module.run)
    assert parser.parse_args([name, *_minimal_args(name)]).command == name


def _minimal_args(name: str) -> list[str]:
    return {"merge": ["--base", "b", "--adapter", "a", "--output", "o"], "export": ["cfg.yaml", "--output", "o"],
            "quantize": ["m", "--format", "q8_0", "--output", "o"], "serve": ["m"],
            "launch": ["--nproc-per-node", "2", "--", "sft", "cfg.yaml"],
            "grpo-colocate": ["--train", "t.yaml", "--infer", "i.yaml", "--orch", "o.yaml"]}.get(name, ["cfg.yaml"])


def test_sft_bad_config_is_one_clean_line(bad_config, capsys):
    assert main(["sft", str(bad_config)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{bad_config}:3:1: learning_rat" in err and "'learning_rate'" in err


def test_sft_config_pointing_at_an_empty_model_config_is_a_clean_error(good_config, capsys):
    assert main(["sft", str(good_config), "--override", "learning_rate=1e-4"]) == 1
    err = capsys.readouterr().err
    assert "model_type None is not supported" in err and "Traceback" not in err


def test_bench_times_a_configs_own_steps(tmp_path, capsys):
    """`surojax bench CONFIG` runs the YAML's trainer for 1 + warmup + steps steps in a temporary output folder:
    one JSON line, the config's own output_dir untouched; a bad config is refused before anything runs."""
    from tests.train.conftest import write_instruction_data

    out = tmp_path / "would-be-output"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(dict(
        model=str(ROOT / "tests" / "fixtures" / "models" / "qwen3"), output_dir=str(out), recipe="fp32",
        lora=True, lora_rank=4, datasets=[{"path": str(write_instruction_data(tmp_path / "d.jsonl", n=16)),
                                           "type": "instruction"}], sequence_len=32, per_device_train_batch_size=2,
        max_steps=100)))
    assert main(["bench", str(config), "--steps", "2", "--warmup", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["trainer"] == "sft" and result["steps"] == 2 and result["tokens_per_s"] > 0
    assert result["step_ms"] > 0 and result["first_step_s"] > 0 and result["loss_first"] > 0
    assert not out.exists()
    assert main(["bench", str(config), "-o", "learning_rate=abc"]) == 1


def test_override_error_and_missing_path(good_config, capsys):
    assert main(["pt", str(good_config), "-o", "learning_rate=abc"]) == 1
    assert "learning_rate" in capsys.readouterr().err
    assert main(["pt", str(good_config), "-o", "datasets.0.path=/nope.jsonl"]) == 1
    err = capsys.readouterr().err
    assert "datasets[0].path: " in err and "/nope.jsonl does not exist" in err


def test_argument_commands_check_paths(tmp_path, capsys):
    assert main(["merge", "--base", str(tmp_path), "--adapter", str(tmp_path / "x"), "--output", "o"]) == 1
    assert "--checkpoint-dir" in capsys.readouterr().err
    assert main(["merge", "--base", str(tmp_path), "--adapter", str(tmp_path), "--output", "o"]) == 1
    assert "adapter_config.json" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 2  # argparse usage error
    assert main(["quantize", str(tmp_path), "--format", "nf4", "--output", "o"]) == 2


def test_run_guarded():
    class Oops(Exception):
        is_user_error = True

    def user_error():
        raise Oops("bad thing [x]")

    def bug():
        raise KeyError("k")

    assert common.run_guarded(lambda: None) == 0
    assert common.run_guarded(lambda: 3) == 3
    assert common.run_guarded(user_error) == 1
    with pytest.raises(KeyError):
        common.run_guarded(bug)


def test_python_m_train_bad_config(bad_config):
    r = run_py("-m", "surojax.train", "--config", str(bad_config))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "learning_rat" in lines[0] and str(bad_config) in lines[0]


def test_python_m_train_reports_setup_errors_cleanly(good_config, capsys):
    """The main `python -m surojax.train` runs (surojax/train/__main__.py), in this process: a setup error after the
    config check is an exit status and a message, not a traceback (a real `python -m surojax.train` process's output:
    test_python_m_train_bad_config)."""
    assert train_main(["--config", str(good_config), "--override", "lora=true"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "model_type None is not supported" in err, err


def test_training_reports_unwrapped_when_stderr_is_not_a_terminal(monkeypatch, capsys, good_config):
    """sft / pt / python -m surojax.train print on a console that never wraps at 80 columns into a log file."""
    import surojax.config.stages as config_stages
    import surojax.train.stages as train_stages

    seen = {}
    monkeypatch.setattr(config_stages, "load_run", lambda config, overrides, overwrite=False: [])
    monkeypatch.setattr(train_stages, "run_stages", lambda stages, console, **kw: seen.setdefault("console", console))
    assert main(["sft", str(good_config)]) == 0
    line = "data    " + "x" * 200
    seen["console"].print(line, highlight=False)
    assert line in capsys.readouterr().err.splitlines()


def test_writing_commands_refuse_an_existing_output_without_overwrite(tmp_path, good_config, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    gguf = tmp_path / "model.gguf"
    gguf.write_text("mine")
    assert main(["merge", "--base", str(tmp_path), "--adapter", str(tmp_path), "--output", str(taken)]) == 1
    assert main(["quantize", str(tmp_path), "--type", "q8_0", "--output", str(gguf)]) == 1
    run_dir = tmp_path / "run"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text("{}")  # the run's final export: export's default --output
    assert main(["export", str(good_config), "-o", f"output_dir={run_dir}"]) == 1
    err = capsys.readouterr().err
    for path in (taken, gguf, run_dir / "model"):
        assert f"{path}: exists and is not empty; pass --overwrite" in err
    assert (taken / "keep.txt").read_text() == gguf.read_text() == "mine"
    assert (run_dir / "model" / "config.json").read_text() == "{}"


def test_run_sh_resume_command_runs_from_the_callers_shell(tmp_path, monkeypatch):
    """After Ctrl-C of `bash scripts/run.sh ARGS` the printed resume command is `bash scripts/run.sh ARGS -o
    resume_from_checkpoint=true` (the venv is active only inside run.sh): run.sh (with a stub env.sh and a fake
    `python` that prints what it got) exports the script path as called and its config; `resume_command_for` builds
    the command from them with the user's overrides, without --overwrite and without repeating the config."""
    from surojax.cli.train_script import build_parser

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "run.sh").write_text((ROOT / "scripts" / "run.sh").read_text())
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$SUROJAX_RUN_SCRIPT" "$SUROJAX_RUN_SCRIPT_CONFIG" "$@"\n')
    fake.chmod(0o755)
    (repo / "scripts" / "env.sh").write_text(f'export PATH="{tmp_path / "bin"}:$PATH"\n')
    r = subprocess.run(["bash", "repo/scripts/run.sh", "-o", "stages.0.max_steps=3", "--overwrite"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    script, config, *argv = r.stdout.splitlines()
    assert (script, config) == ("repo/scripts/run.sh", "configs/quickstart.yaml")
    assert argv == ["-m", "surojax.train", "--config", config, "-o", "stages.0.max_steps=3", "--overwrite"]

    monkeypatch.setenv(common.RUN_SCRIPT_ENV, script)
    monkeypatch.setenv(common.RUN_SCRIPT_CONFIG_ENV, config)
    args = build_parser().parse_args(argv[2:])
    assert common.resume_command_for(args, config_flag=True) == \
        "bash repo/scripts/run.sh -o stages.0.max_steps=3 -o resume_from_checkpoint=true"
    # run.sh with a --config of the user's own: that config is named in the command
    args = build_parser().parse_args([*argv[2:], "--config", "my run.yaml"])
    assert common.resume_command_for(args, config_flag=True) == \
        "bash repo/scripts/run.sh --config 'my run.yaml' -o stages.0.max_steps=3 -o resume_from_checkpoint=true"


def test_resume_command_names_an_executable_the_users_shell_finds(tmp_path, monkeypatch):
    """Without run.sh: `python -m surojax.train` as this interpreter's absolute path (a bare `python` in the user's
    shell may be one without jax); the console script as `surojax` when that is on PATH, else its absolute path."""
    from surojax.cli.train_script import build_parser

    monkeypatch.delenv(common.RUN_SCRIPT_ENV, raising=False)
    args = build_parser().parse_args(["--config", "run.yaml", "-o", "learning_rate=1e-3"])
    assert common.resume_command_for(args, config_flag=True) == \
        f"{shlex.quote(sys.executable)} -m surojax.train --config run.yaml -o learning_rate=1e-3 " \
        "-o resume_from_checkpoint=true"
    args = build_parser_for("sft").parse_args(["sft", "run.yaml", "-o", "max_steps=9"])
    exe = tmp_path / "venv bin" / "surojax"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(exe), "sft", "run.yaml"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert common.resume_command_for(args) == \
        f"{shlex.quote(str(exe))} sft run.yaml -o max_steps=9 -o resume_from_checkpoint=true"
    monkeypatch.setenv("PATH", f"{exe.parent}:/usr/bin:/bin")
    assert common.resume_command_for(args) == "surojax sft run.yaml -o max_steps=9 -o resume_from_checkpoint=true"


def build_parser_for(command: str):
    return build_parser(command, load_command(command))


def test_an_empty_dataset_is_one_error_line(tmp_path):
    """`surojax sft` of a config whose only dataset has no rows prints the error alone: no `WARNING:name:` line
    (the root handler importing orbax installs through absl) before it."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(ROOT / "tests" / "fixtures" / "models" / "qwen3"), "recipe": "fp32",
                                      "datasets": [{"path": str(empty), "type": "text"}], "max_steps": 1,
                                      "output_dir": str(tmp_path / "out")}))
    r = run_py("-m", "surojax.cli.main", "sft", str(config))
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no training examples left"), r.stderr
