"""LoRA over pre-quantised checkpoints (tests/fixtures/prequant: FP8 blocks, compressed-tensors FP8, ModelOpt NVFP4,
bitsandbytes NF4) through the Trainer: `model: <folder>` + `lora: true` trains the adapters over the checkpoint's
own quantised kernels, no `qlora:` needed, and the base stays quantised; the loss and LoRA gradients over the
quantised base equal those over its dequantised copy; `qlora:` naming the checkpoint's own format keeps it,
another format and full fine-tuning are refused before any weight is read."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.config import config_from_dict
from surojax.peft.lora import LORA_TARGETS, base_linear
from surojax.quant.model import dequantize_model, is_quantized
from surojax.quant import NF4, NVFP4, FP8Block
from surojax.train.model_setup import build_model
from surojax.train.run_spec import TrainSetupError, run_spec
from surojax.train.trainer import Trainer

from tests.train.conftest import ROOT, TOKENIZER, write_instruction_data

FIXTURES = ROOT / "tests" / "fixtures" / "prequant"
FORMATS = {"fp8_block": FP8Block, "ct_fp8": FP8Block, "modelopt_nvfp4": NVFP4, "bnb_nf4": NF4}


def _cfg(tmp_path, folder, **kw):
    return config_from_dict(dict(
        model=str(FIXTURES / folder), tokenizer=str(TOKENIZER), output_dir=str(tmp_path / "out"), recipe="fp32",
        recompute="none", lora=True, lora_rank=4, lora_alpha=8,
        datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl")), "type": "instruction"}],
        sequence_len=32, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=2e-2,
        lr_scheduler_type="constant", max_steps=3, seed=0, **kw))


@pytest.mark.parametrize("folder", FORMATS)
def test_lora_trains_over_the_checkpoints_own_quantisation(tmp_path, folder):
    """... and the memory plan counts the base at its stored size: the frozen state's bytes within 7% (the plan
    takes each format's scales at its default block, and leaves out NF4's 1 KiB code book per kernel, 6% of this
    tiny model; counted in the fp32 base dtype, as before, the base would be 2.3x its size)."""
    trainer = Trainer(_cfg(tmp_path, folder))
    model = trainer.trained_model()
    assert {type(base_linear(model, t).kernel.get_value()) for t in LORA_TARGETS} == {FORMATS[folder]}
    frozen_bytes = sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(trainer.frozen))
    assert trainer.memory_plan.weights == pytest.approx(frozen_bytes, rel=0.07)
    trainer.train()
    losses = [r["loss"] for r in trainer.metrics.history if "loss" in r]
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    trained = trainer.trained_model()
    assert {type(base_linear(trained, t).kernel.get_value()) for t in LORA_TARGETS} == {FORMATS[folder]}
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_loss_and_grads_over_the_quantised_base_equal_the_dequantised_ones(tmp_path):
    """Same math: over the NVFP4 base (kept quantised) and over a copy with every kernel dequantised to float32,
    the loss and the adapters' gradients agree to float32 rounding (the quantised kernel multiplies as
    x @ dequantize() in float32 on this path, the same values; only XLA's order of float32 operations may
    differ: rtol 1e-4 as for the GGUF base, tests/weights/test_gguf_training.py)."""
    spec = run_spec(_cfg(tmp_path, "modelopt_nvfp4"), total_steps=1)
    quant, plain = build_model(spec), build_model(spec)
    dequantize_model(plain, jnp.float32)
    assert set(is_quantized(quant).values()) == {"nvfp4"} and not is_quantized(plain)
    ids = jnp.asarray([[507, 12, 300, 45, 7, 99, 250, 401, 3, 88, 160, 509]])

    def loss_and_grads(model):
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # lora_b non-zero: a real gradient
            if p[-1] == "lora_b":
                v.set_value(jnp.full(v.get_value().shape, 0.01, v.get_value().dtype))
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

        def loss(lora, rest):
            logits = nnx.merge(graphdef, lora, rest)(ids[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))
        return jax.jit(jax.value_and_grad(loss))(lora, rest)

    (lq, gq), (lp, gp) = loss_and_grads(quant), loss_and_grads(plain)
    np.testing.assert_allclose(float(lq), float(lp), rtol=1e-4)
    for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_qlora_over_a_prequantised_base(tmp_path):
    """`qlora:` naming the checkpoint's format is the checkpoint's own (nothing re-quantised); another format would
    round twice and is refused, as is full fine-tuning, both before any weight is read."""
    assert run_spec(_cfg(tmp_path, "fp8_block", qlora_fp8=True), total_steps=1).quant is None
    assert run_spec(_cfg(tmp_path, "bnb_nf4", qlora_bnb=True), total_steps=1).quant is None
    with pytest.raises(TrainSetupError, match=r"qlora: nf4: model: .*fp8_block is already quantised \(fp8 "
                                              r"\(transformers fine-grained FP8.*Remove qlora"):
        run_spec(_cfg(tmp_path, "fp8_block", qlora_bnb=True), total_steps=1)
    with pytest.raises(TrainSetupError, match=r"qlora_bnb_double_quant: False: .* stored as NF4 with double "
                                              r"quantisation"):
        run_spec(_cfg(tmp_path, "bnb_nf4", qlora_bnb=True, qlora_bnb_double_quant=False), total_steps=1)
    cfg = _cfg(tmp_path, "ct_fp8").model_copy(update={"lora": False})
    with pytest.raises(TrainSetupError, match=r"is pre-quantised \(compressed-tensors.*set lora: true"):
        run_spec(cfg, total_steps=1)


def test_what_cannot_run_over_a_prequantised_base_is_refused_before_the_data(tmp_path, monkeypatch):
    """Full fine-tuning, merge_adapter (surojax merge dequantises the base afterwards) and a stacked adapter folded
    in (adapter_init_mode merge): an adapter cannot be folded into quantised weights. Refused by the Trainer before
    it reads any data."""
    monkeypatch.setattr(Trainer, "build_data", lambda *a, **k: pytest.fail("the data was read first"))
    with pytest.raises(TrainSetupError, match=r"merge_adapter: model: .*modelopt_nvfp4 is pre-quantised .*surojax "
                                              r"merge --base-model"):
        Trainer(_cfg(tmp_path, "modelopt_nvfp4", merge_adapter=True))
    with pytest.raises(TrainSetupError, match=r"is pre-quantised \(bitsandbytes.*set lora: true"):
        Trainer(_cfg(tmp_path, "bnb_nf4").model_copy(update={"lora": False}))
    with pytest.raises(TrainSetupError, match=r"adapter_init_mode: merge: .*fp8_block is pre-quantised .* "
                                              r"adapter_init_mode: trainable"):
        Trainer(_cfg(tmp_path, "fp8_block", adapter_path=str(tmp_path / "an_adapter")))
