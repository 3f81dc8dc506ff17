"""LoRA training leaves the base bit-identical and exports a PEFT adapter that reloads to the trained model;
full fine-tuning exports an HF folder that reloads to the trained model."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.config import config_from_dict
from surojax.peft.stacked import load_adapter_into
from surojax.train.trainer import Trainer
from surojax.weights.hf_checkpoint import load_model

from tests.train.conftest import ROOT, write_hybrid_model, write_instruction_data

BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3"
TOKENS = jnp.asarray([[508, 3, 17, 99, 250, 7, 509, 42]])


def _lora_cfg(tmp_path, **kw):
    return config_from_dict(dict(
        model=str(BASE), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="full", lora=True,
        lora_rank=4, lora_alpha=8, lora_dropout=0.1, datasets=[{"path": str(write_instruction_data(
            tmp_path / "inst.jsonl")), "type": "instruction"}], sequence_len=64, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-2, max_steps=3, validation_split_ratio=0.25) | kw)


def test_lora_training_keeps_the_base_and_exports_a_peft_adapter(tmp_path):
    base_before = {k: np.array(v) for k, v in _flat(load_model(BASE)).items()}
    trainer = Trainer(_lora_cfg(tmp_path))
    trainer.train()
    trained = trainer.trained_model()
    frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    frozen_after = {k.replace(".base", ""): np.asarray(v) for k, v in _flat(trained, frozen).items()}
    assert frozen_after.keys() == base_before.keys()
    for k in base_before:
        assert np.array_equal(frozen_after[k], base_before[k]), k  # bit-identical
    lora_b = [np.asarray(v) for k, v in _flat(trained, nnx.LoRAParam).items() if k.endswith("lora_b")]
    assert lora_b and all(np.abs(b).max() > 0 for b in lora_b)  # the adapter did train

    adapter = tmp_path / "out" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "tokenizer.json").is_file()
    reloaded = load_adapter_into(load_model(BASE), adapter, trainable=True)
    np.testing.assert_allclose(np.asarray(reloaded(TOKENS)), np.asarray(trained(TOKENS)), atol=1e-5)
    assert not np.allclose(np.asarray(load_model(BASE)(TOKENS)), np.asarray(trained(TOKENS)), atol=1e-4)
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000


def test_full_finetune_exports_an_hf_folder_that_reloads(tmp_path):
    """A random model of the gemma4_text fixture's architecture (sliding and full layers with their own ropes, the v
    norm, layer scalars: every weight of it trained and written back). One architecture suffices: the Trainer's
    export (save_model of the trained model) is one path for every family (a plain qwen3 run took it again; each
    family's save_model round trip: tests/weights/test_hf_checkpoint.py, tests/models/test_*.py). No validation split
    and no remat: neither is what this checks, and each would compile a program more."""
    base = write_hybrid_model(tmp_path / "base", family="gemma4_text")
    cfg = _lora_cfg(tmp_path, model=str(base)).model_copy(update={
        "lora": False, "lora_dropout": 0.0, "validation_split_ratio": 0.0, "recompute": "none"})
    trainer = Trainer(cfg)
    trainer.train()
    reloaded = load_model(tmp_path / "out" / "model")
    np.testing.assert_array_equal(np.asarray(reloaded(TOKENS)), np.asarray(trainer.trained_model()(TOKENS)))
    assert not np.allclose(np.asarray(load_model(base)(TOKENS)), np.asarray(reloaded(TOKENS)), atol=1e-4)


def test_refuses_to_overwrite_a_finished_run(tmp_path):
    (tmp_path / "out" / "adapter").mkdir(parents=True)
    from surojax.train.model_setup import TrainSetupError

    with pytest.raises(TrainSetupError, match="already holds a trained adapter"):
        Trainer(_lora_cfg(tmp_path))


def _flat(model, filt=nnx.Param):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, filt))}
