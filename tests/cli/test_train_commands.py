"""The training-side commands end to end: tokenize --debug, sft, export from a checkpoint, merge."""
import json

import jax.numpy as jnp
import numpy as np
import yaml

from surojax.cli.main import main
from surojax.peft.stacked import load_adapter_into
from surojax.weights.hf_checkpoint import load_model

from tests.train.conftest import ROOT, write_instruction_data

BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3"
TOKENS = jnp.asarray([[508, 3, 17, 99, 250, 7, 509, 42]])


def _config(tmp_path, **kw):
    cfg = dict(model=str(BASE), output_dir=str(tmp_path / "run"), recipe="fp32", lora=True, lora_rank=4,
               lora_alpha=8, datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl")),
                                        "type": "instruction"}], sequence_len=64, per_device_train_batch_size=2,
               learning_rate=1e-2, max_steps=4, save_steps=2, **kw)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_tokenize_debug_marks_the_supervised_tokens(tmp_path, capsys):
    assert main(["tokenize", str(_config(tmp_path)), "--debug", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "«" in out  # supervised tokens are wrapped when the console has no colour
    assert "examples" in out and "packing efficiency" in out


def test_sft_then_export_then_merge(tmp_path, capsys):
    config = _config(tmp_path)
    assert main(["sft", str(config)]) == 0
    adapter = tmp_path / "run" / "adapter"
    trained = load_adapter_into(load_model(BASE), adapter, trainable=True)

    # export the step-2 checkpoint: a different (earlier) adapter than the final one
    assert main(["export", str(config), "--checkpoint", str(tmp_path / "run" / "checkpoints" / "2"),
                 "--output", str(tmp_path / "step2")]) == 0
    step2 = load_adapter_into(load_model(BASE), tmp_path / "step2", trainable=True)
    assert json.loads((tmp_path / "step2" / "adapter_config.json").read_text())["r"] == 4
    assert not np.allclose(np.asarray(step2(TOKENS)), np.asarray(trained(TOKENS)), atol=1e-5)

    assert main(["merge", "--base-model", str(BASE), "--checkpoint-dir", str(tmp_path / "run"), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = load_model(tmp_path / "merged")
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), np.asarray(trained(TOKENS)), atol=2e-5)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    capsys.readouterr()
