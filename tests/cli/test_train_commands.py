"""The training-side commands end to end: tokenize --debug, sft, export from a checkpoint, merge; nothing an
earlier run wrote is replaced without --overwrite; multi-stage configs take --stage."""
import json
from pathlib import Path

import pytest

import jax.numpy as jnp
import numpy as np
import yaml

from surojax.cli.main import main
from surojax.config import load_config
from surojax.train.trainers import make_trainer
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model

from tests.tiny import QWEN3, hf
from tests.train.conftest import ROOT, TOKENIZER, write_instruction_data, write_text_data

BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3"
TOKENS = jnp.asarray([[508, 3, 17, 99, 250, 7, 509, 42]])


def _config(tmp_path, **kw):
    cfg = dict(model=str(BASE), output_dir=str(tmp_path / "run"), recipe="fp32", lora=True, lora_rank=4,
               lora_alpha=8, datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl")),
                                        "type": "instruction"}], sequence_len=64, per_device_train_batch_size=2,
               learning_rate=1e-2, max_steps=4, save_steps=2)
    cfg.update(kw)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_tokenize_debug_marks_the_supervised_tokens(tmp_path, capsys):
    assert main(["tokenize", str(_config(tmp_path)), "--debug", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "«" in out  # supervised tokens are wrapped when the console has no colour
    assert "examples" in out and "packing efficiency" in out


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A finished LoRA run (checkpoints at steps 2 and 4, the adapter): (its folder, its config). Tests that change
    it work on a copy."""
    root = tmp_path_factory.mktemp("sft_run")
    config = _config(root)
    assert main(["sft", str(config)]) == 0
    return root, config


def test_sft_then_export_then_merge(sft_run, tmp_path, capsys):
    run_root, config = sft_run
    adapter = run_root / "run" / "adapter"
    trained = load_adapter_into(load_model(BASE), adapter, trainable=True)
    final = _snapshot(adapter)

    # nothing the run wrote is replaced without --overwrite: a second sft, an export to the default folder
    capsys.readouterr()
    assert main(["sft", str(config)]) == 1
    assert main(["export", str(config), "--checkpoint", str(run_root / "run" / "checkpoints" / "2")]) == 1
    err = capsys.readouterr().err
    assert err.count(f"{adapter}") == 2 and err.count("--overwrite") == 2, err
    assert _snapshot(adapter) == final

    # export the step-2 checkpoint: a different (earlier) adapter than the final one
    assert main(["export", str(config), "--checkpoint", str(run_root / "run" / "checkpoints" / "2"),
                 "--output", str(tmp_path / "step2")]) == 0
    step2 = load_adapter_into(load_model(BASE), tmp_path / "step2", trainable=True)
    assert json.loads((tmp_path / "step2" / "adapter_config.json").read_text())["r"] == 4
    assert not np.allclose(np.asarray(step2(TOKENS)), np.asarray(trained(TOKENS)), atol=1e-5)

    assert main(["merge", "--base-model", str(BASE), "--checkpoint-dir", str(run_root / "run"), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = load_model(tmp_path / "merged")
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), np.asarray(trained(TOKENS)), atol=2e-5)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    capsys.readouterr()


def test_a_checkpoint_that_does_not_fit_is_a_named_error(sft_run, tmp_path, capsys):
    """Resuming with a changed lora_rank, exporting a step that does not exist, exporting with another run's config:
    one clean error each, naming the key (checkpoint's value, config's value) or the steps there, before orbax
    reads an array; nothing written."""
    run_root, config = sft_run
    checkpoints = run_root / "run" / "checkpoints"
    before = _snapshot(run_root / "run")
    capsys.readouterr()
    assert main(["sft", str(config), "-o", "lora_rank=8", "-o", "resume_from_checkpoint=true"]) == 1
    err = capsys.readouterr().err
    assert f"checkpoint {checkpoints / '4'} does not fit" in err and "lora_rank: 4 in the checkpoint's run, 8 in" in err
    assert "Traceback" not in err and len([line for line in err.splitlines() if line.startswith("error:")]) == 3, err

    assert main(["export", str(config), "--checkpoint", str(checkpoints / "3"), "--output", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert f"checkpoint {checkpoints / '3'}: no such checkpoint; the checkpoints in {checkpoints} are steps 2, 4" in err

    other = _config(tmp_path, lora_alpha=16)  # another run: its own output_dir, another adapter scale
    assert main(["export", str(other), "--checkpoint", str(checkpoints / "2"), "--output", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert f"(written by the run in {run_root / 'run'}) does not fit this config" in err
    assert "lora_alpha: 8.0 in the checkpoint's run, 16.0 in this config" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists() and _snapshot(run_root / "run") == before


def test_a_resume_announces_the_keys_that_changed(sft_run, capsys):
    """learning_rate and max_steps may change on resume: the run is restored at its step with the new plan, and
    each change is printed (old -> new)."""
    _, config = sft_run
    capsys.readouterr()
    trainer = make_trainer(load_config(config, ["resume_from_checkpoint=true", "max_steps=6", "learning_rate=2e-2"]))
    trainer.close()
    assert (trainer.step_count, trainer.plan.total_steps) == (4, 6)
    err = capsys.readouterr().err
    for change in ("max_steps: 4 -> 6", "learning_rate: 0.01 -> 0.02"):
        assert f"changed since the checkpoint's run: {change}\n" in err, err
    assert err.count("changed since") == 2


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _two_stages(tmp_path) -> Path:
    text = write_text_data(tmp_path / "text.jsonl", n=32)
    qa = write_instruction_data(tmp_path / "qa.jsonl", n=24)
    cfg = {"tokenizer": str(TOKENIZER), "recipe": "fp32", "recompute": "none", "sequence_len": 64,
           "per_device_train_batch_size": 2, "max_steps": 2, "save_steps": 2, "stages": [
               {"name": "pretrain", "from_scratch": True, "model_config": hf(QWEN3),
                "datasets": [{"path": str(text), "type": "text"}], "output_dir": str(tmp_path / "out" / "pre")},
               {"name": "lora", "model": str(tmp_path / "out" / "pre" / "model"), "lora": True, "lora_rank": 4,
                "datasets": [{"path": str(qa), "type": "instruction"}], "output_dir": str(tmp_path / "out" / "lora")}]}
    path = tmp_path / "stages.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_second_run_of_a_finished_multi_stage_config_changes_nothing(tmp_path, capsys):
    config = _two_stages(tmp_path)
    assert main(["sft", str(config)]) == 0
    first = _snapshot(tmp_path / "out")
    assert "pre/checkpoints/2/meta/metadata" in first and "lora/adapter/adapter_model.safetensors" in first
    capsys.readouterr()
    assert main(["sft", str(config)]) == 0
    err = capsys.readouterr().err
    assert err.count("already complete") == 2 and "--overwrite" in err
    assert _snapshot(tmp_path / "out") == first

    # --stage NAME|N picks one stage of it for export and tokenize
    assert main(["export", str(config), "--stage", "lora", "--output", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "adapter_config.json").is_file()
    assert main(["tokenize", str(config), "--stage", "0"]) == 0
    assert "32 examples" in capsys.readouterr().out  # the pretrain stage's 32 rows (the lora stage has 24)
    assert _snapshot(tmp_path / "out") == first


def test_pt_trains_only_the_pretraining_stages(tmp_path, capsys, monkeypatch):
    """`surojax pt` of the two-stage config trains its pretrain stage and names the LoRA stage it skips (an
    instruction dataset: `surojax sft` trains it); a plain config that is not pretraining is refused."""
    import surojax.train.stages as train_stages

    trained = []
    monkeypatch.setattr(train_stages, "run_stages", lambda stages, **kw: trained.extend(stages))
    config = _two_stages(tmp_path)
    assert main(["pt", str(config)]) == 0
    assert [s.name for s in trained] == ["pretrain"]
    assert (f"stage lora: skipped, not pretraining (datasets[0].type: instruction); `surojax sft {config}` runs "
            "every stage") in capsys.readouterr().err
    sft = _config(tmp_path)
    assert main(["pt", str(sft)]) == 1 and [s.name for s in trained] == ["pretrain"]
    assert f"{sft}: not a pretraining run (datasets[0].type: instruction)" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [None, "2", "nope"])
def test_a_multi_stage_config_needs_an_existing_stage(tmp_path, capsys, stage):
    argv = ["tokenize", str(_two_stages(tmp_path))] + ([] if stage is None else ["--stage", stage])
    assert main(argv) == 1
    assert "0=pretrain, 1=lora" in capsys.readouterr().err
