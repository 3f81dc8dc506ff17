"""LoRA and QLoRA through the Trainer on a MoE base (the tiny transformers-made qwen3_moe fixture): the adapter on
attention + experts trains, exports as a PEFT folder, and reloads to the trained model -- through the one model
loader (adapter folded into the base), through `merge_adapter`'s HF folder, over an NF4 base for QLoRA, and with
the router trained alongside (`train_router`, PEFT `modules_to_save`).

Two training runs (each compiles its own step): QLoRA (the router frozen: the export's config without
modules_to_save) and LoRA with the router trained and merge_adapter (the folded and merged reloads, the adapter's
experts plus its router). A third run, plain LoRA with merge_adapter, would compile another step for a subset of the
second's path (folding / merging the experts' adapters without a router: the same fold)."""
import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.config import config_from_dict
from surojax.model_loader import load_model_ref
from surojax.peft.lora import lora_modules
from surojax.quant.model import quantize_model
from surojax.peft.stacked import load_adapter_into
from surojax.peft.trained_router import has_trained_router
from surojax.quant import NF4
from surojax.train.trainer import Trainer
from surojax.weights.hf_checkpoint import load_model

from tests.train.conftest import ROOT, write_text_data

BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3_moe"
TOKENS = jnp.asarray([[508, 3, 17, 99, 250, 7, 509, 42], [11, 400, 23, 5, 77, 301, 2, 9]])
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
ROUTER = ("layers", "mlp", "router", "kernel")


def _train(tmp_path, **kw) -> Trainer:
    cfg = config_from_dict(dict(
        model=str(BASE), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none", lora=True,
        lora_rank=4, lora_alpha=8, lora_target_modules="all-linear",
        datasets=[{"path": str(write_text_data(tmp_path / "text.jsonl", n=16)), "type": "text"}],
        sequence_len=32, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=5e-3,
        lr_scheduler_type="constant", max_steps=5, **kw))
    trainer = Trainer(cfg)
    trainer.train()
    losses = [r["loss"] for r in trainer.metrics.history if "loss" in r]
    assert losses[-1] < losses[0]
    return trainer


def _logits(model) -> np.ndarray:
    return np.asarray(model(TOKENS))


def test_qlora_over_nf4_experts_exports_an_adapter_that_reloads(tmp_path):
    """QLoRA on attention + experts (the router frozen): every all-linear target has an adapter, exported with the
    experts in PEFT's target_parameters layout and no modules_to_save; reloaded over the same NF4 base it is the
    trained model."""
    trainer = _train(tmp_path, qlora_bnb=True)
    trained = trainer.trained_model()
    assert tuple(lora_modules(trained)) == ALL_LINEAR
    cfg = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert cfg["modules_to_save"] is None  # the router stayed frozen
    assert isinstance(trained.layers.mlp.experts.gate_up_proj.base.kernel.get_value(), NF4)
    # the same NF4 base (quantisation is deterministic), the exported adapter loaded on top: the trained model
    base = load_model(BASE)
    quantize_model(base, trainer.spec.quant.format, **dict(trainer.spec.quant.options))
    reloaded = load_adapter_into(base, tmp_path / "out" / "adapter", trainable=True)
    np.testing.assert_allclose(_logits(reloaded), _logits(trained), rtol=0, atol=2e-5)


def test_train_router_adapter_round_trips_with_its_router(tmp_path):
    """LoRA on attention + experts with the router trained and merge_adapter: the adapter and router changed the
    model; the export holds the router as modules_to_save; loaded folded (load_model_ref: base + adapter folded into
    the kernels, the router a plain weight again), as merge_adapter's HF folder, and continued (the router trains
    again), each is the trained model."""
    trainer = _train(tmp_path, train_router=True, merge_adapter=True)
    trained = trainer.trained_model()
    assert tuple(lora_modules(trained)) == ALL_LINEAR
    router = np.asarray(dict(nnx.to_flat_state(nnx.state(trained, nnx.Param)))[ROUTER].get_value())
    base_router = np.asarray(load_model(BASE).layers.mlp.router.kernel.get_value())
    assert np.abs(router - base_router).max() > 1e-4  # the router trained
    adapter = tmp_path / "out" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == ["gate"]
    want = _logits(trained)
    assert np.abs(want - _logits(load_model(BASE))).max() > 1e-3  # the adapter changed the model
    assert json.loads((adapter / "adapter_config.json").read_text())["target_parameters"] == [
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    folded = load_model_ref(adapter).model
    assert not has_trained_router(folded)  # folded: the router is the model's plain weight again
    np.testing.assert_array_equal(np.asarray(folded.layers.mlp.router.kernel.get_value()), router)
    np.testing.assert_allclose(_logits(folded), want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(_logits(load_model(tmp_path / "out" / "merged")), want, rtol=0, atol=2e-5)
    resumed = load_adapter_into(load_model(BASE), adapter, trainable=True)  # continued: the router trains again
    assert has_trained_router(resumed)
    np.testing.assert_allclose(_logits(resumed), want, rtol=0, atol=2e-5)
