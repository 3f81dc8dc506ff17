"""QLoRA through the Trainer: `qlora_bnb: true` quantises the fixture model's linear kernels to NF4 before LoRA,
the adapter trains and exports as PEFT, the base stays quantised; the qlora keys that cannot work fail clearly."""
import json

import numpy as np
import pytest
from flax import nnx

from surojax.config import ConfigError, config_from_dict
from surojax.peft.lora import LORA_TARGETS, base_linear
from surojax.quant import NF4, Q8_0
from surojax.train.model_setup import build_model as build_spec_model
from surojax.train.run_spec import TrainSetupError, run_spec
from surojax.train.trainer import Trainer

from tests.train.conftest import ROOT, write_instruction_data

BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3"


def build_model(cfg):
    return build_spec_model(run_spec(cfg, total_steps=1))


def _cfg(tmp_path, **kw):
    return config_from_dict(dict(
        model=str(BASE), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none", lora=True,
        lora_rank=4, lora_alpha=8, datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl")),
                                                "type": "instruction"}],
        sequence_len=64, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-2,
        lr_scheduler_type="constant", max_steps=6, **kw))


def test_qlora_nf4_trains_and_exports_an_adapter(tmp_path):
    trainer = Trainer(_cfg(tmp_path, qlora_bnb=True))
    for name in LORA_TARGETS:
        assert isinstance(base_linear(trainer.trained_model(), name).kernel.get_value(), NF4)
    trainer.train()
    trained = trainer.trained_model()
    for name in LORA_TARGETS:  # the base stayed quantised (double quant by default)
        value = base_linear(trained, name).kernel.get_value()
        assert isinstance(value, NF4) and value.double_quant
    lora_b = [np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(trained, nnx.LoRAParam))
              if p[-1] == "lora_b"]
    assert len(lora_b) == len(LORA_TARGETS) and all(np.abs(b).max() > 0 for b in lora_b)
    losses = [r["loss"] for r in trainer.metrics.history if "loss" in r]
    assert losses and losses[-1] < losses[0]
    adapter = tmp_path / "out" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4


def test_qlora_gguf_quantisable_type_builds(tmp_path):
    model = build_model(_cfg(tmp_path, qlora_gguf="q8_0"))
    assert isinstance(base_linear(model, "down_proj").kernel.get_value(), Q8_0)
    assert isinstance(model.layers.mlp.down_proj.lora_a, nnx.LoRAParam)


@pytest.mark.parametrize("kw,match", [
    ({"qlora_bnb": True, "qlora_bnb_block_size": 128}, "block size 64"),
    ({"qlora_fp8": True, "qlora_block_size": 64}, "128 x 128"),
    ({"qlora_bnb": True, "merge_adapter": True}, "merge_adapter: cannot fold"),
])
def test_qlora_setups_that_cannot_work_fail_clearly(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):  # refused by the config check, before anything is built
        _cfg(tmp_path, **kw)


def test_full_finetune_over_a_quantised_base_is_refused(tmp_path):
    with pytest.raises(Exception, match="set lora: true"):  # the config rules refuse it ...
        config_from_dict(dict(_cfg(tmp_path).model_dump(by_alias=True), lora=False, qlora_bnb=True,
                              lora_rank=16, lora_alpha=32.0))
    cfg = _cfg(tmp_path, qlora_bnb=True).model_copy(update={"lora": False})  # ... and so does the model set-up
    with pytest.raises(TrainSetupError, match="full fine-tuning over a quantized base is not possible"):
        build_model(cfg)
