"""gpt-oss's published MXFP4 experts (`*_blocks` / `*_scales`): dequantised (full fine-tuning, merging) or kept
packed in the `mxfp4` format (a frozen base: LoRA, serving), both equal to transformers' own dequantisation bit for
bit (tests/fixtures/mxfp4, scripts/make_mxfp4_fixtures.py) and to the OCP spec's E2M1 / E8M0 tables; the packed
model computes the dequantised model's logits, and LoRA trains over it through the Trainer with the base packed."""
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from surojax.config import config_from_dict
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.peft.lora import base_linear
from surojax.quant import MXFP4
from surojax.quant.transform import QuantParam
from surojax.train.run_spec import run_spec
from surojax.train.trainer import Trainer
from surojax.weights.hf_checkpoint import hf_tensors, load_model, save_model
from surojax.weights.mxfp4_checkpoint import dequantize_mxfp4
from surojax.weights.safetensors_file import SafetensorsFile, WeightsError, write_safetensors
from tests.train.conftest import write_instruction_data

FIXTURES = Path(__file__).parents[1] / "fixtures"
CHECKPOINT = FIXTURES / "models" / "gpt_oss_mxfp4"  # transformers-made, experts MXFP4 as openai publishes them
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX spec, table "FP4 (E2M1)": codes 0..7, bit 3 the sign
HF = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
          attention_bias=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
          quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})


def spec_value(code: int, exponent: int) -> float:
    """The OCP MX spec: E2M1 element x E8M0 scale 2^(exponent - 127) (exponent 255 is NaN)."""
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * 2.0 ** (exponent - 127)


def bf16_bits(x) -> np.ndarray:
    return np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)


@functools.partial(jax.jit, static_argnums=1)
def dequantize(w, dtype):  # one compilation per shape instead of one per operation (eager)
    return w.dequantize(dtype)


def test_dequantisation_equals_transformers_bit_for_bit():
    """Every code in both nibbles and every exponent 0..254 (subnormals, overflow to inf included), and the
    fixture checkpoint's experts: numpy's dequantisation (load) and the packed format's (compute) give the bits of
    transformers' convert_moe_packed_tensors, -0.0 included."""
    v = np.load(FIXTURES / "mxfp4" / "vectors.npz")
    blocks, scales, want = v["blocks"], v["scales"], v["dequantized"]
    assert set(scales.ravel()) == set(range(255))
    np.testing.assert_array_equal(bf16_bits(dequantize_mxfp4(blocks, scales)), want)
    packed = MXFP4.from_blocks_scales(blocks, scales)
    assert packed.shape == want.shape[-2:] and packed.negative_zero
    np.testing.assert_array_equal(np.asarray(dequantize(packed, jnp.bfloat16)).view(np.uint16), want)

    digests = json.loads((FIXTURES / "mxfp4" / "checkpoint.json").read_text())
    model = load_model(CHECKPOINT, keep_quantized=True)
    experts = model.layers.mlp.experts
    stacks = {proj: np.asarray(dequantize(getattr(experts, proj).kernel.get_value(), jnp.bfloat16)).view(np.uint16)
              for proj in ("gate_up_proj", "down_proj")}  # [L, E, in, out]
    assert len(digests) == 2 * model.cfg.num_layers
    for name, ref in digests.items():
        got = stacks[name.split(".")[-1]][int(name.split(".")[2])]
        assert list(got.shape) == ref["shape"] and hashlib.sha256(got.tobytes()).hexdigest() == ref["sha256"], name


def test_values_follow_the_ocp_tables():
    """Each of the 16 E2M1 codes under E8M0 exponents from the smallest (2^-127) to the largest (2^127): the
    spec's value (float32: 6 x 2^127 overflows to inf); +0 for code 8 where ggml's table is followed (GGUF)."""
    exponents = [0, 1, 2, 100, 126, 127, 128, 200, 253, 254]
    codes = np.arange(32, dtype=np.uint8) % 16  # element m of a block holds code m % 16
    blocks = np.tile(codes[0::2] | (codes[1::2] << 4), (len(exponents), 1, 1))  # [N, 1, 16]
    scales = np.asarray(exponents, np.uint8)[:, None]
    for negative_zero in (True, False):
        w = dataclasses.replace(MXFP4.from_blocks_scales(blocks, scales), negative_zero=negative_zero)
        got = np.asarray(dequantize(w, jnp.float32))  # [32, N]
        with np.errstate(over="ignore"):
            want = np.asarray([[spec_value(int(c), e) for e in exponents] for c in codes], np.float32)
        if not negative_zero:
            want[want == 0] = 0.0
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    nan = scales.copy()
    nan[3, 0] = 0xFF
    with pytest.raises(WeightsError, match=r"t\.w: scale byte 0xFF \(NaN in the OCP MX spec\) at block \[3, 0\]"):
        dequantize_mxfp4(blocks, nan, source="t.w")


def test_published_checkpoint_loads_dequantised_or_packed(tmp_path):
    """Dequantised: float experts [E, in, out], the numpy decoding of the pairs, equal to the packed weights'
    decoding; saved as a plain float checkpoint. Packed: a QuantParam holding `mxfp4` leaves
    [L, E, out, in/32 * 17] (4.25 bits a value)."""
    plain, packed = load_model(CHECKPOINT), load_model(CHECKPOINT, keep_quantized=True)
    stored = SafetensorsFile(CHECKPOINT / "model.safetensors")
    name = "model.layers.2.mlp.experts.down_proj"
    np.testing.assert_array_equal(hf_tensors(plain)[name], dequantize_mxfp4(stored.get(name + "_blocks"),
                                                                            stored.get(name + "_scales")))
    var = packed.layers.mlp.experts.down_proj.kernel
    assert isinstance(var, QuantParam) and isinstance(var.get_value(), MXFP4)
    L, E, F, D = 4, 8, 32, 64
    assert var.get_value().data.shape == (L, E, D, F // 32 * 17)
    assert var.get_value().nbytes * 8 / (L * E * F * D) == 4.25
    np.testing.assert_array_equal(np.asarray(dequantize(var.get_value(), jnp.float32)),
                                  np.asarray(plain.layers.mlp.experts.down_proj.kernel.get_value()))
    save_model(plain, tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())


def test_unpaired_blocks_are_reported(tmp_path):
    tensors = hf_tensors(Decoder(ModelConfig.from_hf(HF), rngs=nnx.Rngs(0)))
    name = "model.layers.0.mlp.experts.down_proj"
    del tensors[name]
    tensors[name + "_blocks"] = np.zeros((4, 64, 1, 16), np.uint8)  # no _scales
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF))
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model\.layers\.0\.mlp\.experts\.down_proj"):
        load_model(d)


@nnx.jit
def _logits(model, tokens):
    return model(tokens)


def test_packed_experts_give_the_dequantised_models_logits():
    """Same math: the grouped GEMM over the packed experts is the one over their dequantised bf16 copy, so the bf16
    logits are equal bit for bit (the dequantised model's are transformers': tests/models/test_hf_parity.py)."""
    tokens = jnp.asarray([np.load(CHECKPOINT / "expected.npz")["tokens2"]])
    plain = load_model(CHECKPOINT, dtype=jnp.bfloat16, attention="xla")
    packed = load_model(CHECKPOINT, dtype=jnp.bfloat16, attention="xla", keep_quantized=True)
    assert isinstance(packed.layers.mlp.experts.gate_up_proj.kernel.get_value(), MXFP4)
    assert plain.layers.mlp.experts.gate_up_proj.kernel.get_value().dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(_logits(packed, tokens), np.float32),
                                  np.asarray(_logits(plain, tokens), np.float32))


def _train_config(tmp_path, **kw):
    lora = dict(lora=True, lora_rank=4, lora_alpha=8) if kw.pop("lora", True) else {}
    return config_from_dict({**dict(
        model=str(CHECKPOINT), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none", **lora,
        datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl")),
                                                "type": "instruction"}],
        sequence_len=32, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-2,
        lr_scheduler_type="constant", max_steps=3), **kw})


def test_lora_trains_over_the_packed_experts(tmp_path, capsys):
    """LoRA on attention and the experts (one adapter per expert) over the MXFP4 experts: 3 steps through the
    Trainer; the base stays packed before and after, the start-up summary says so, and the memory plan counts the
    base at its packed size (the frozen state's bytes exactly: bf16 would count the experts 3.8x)."""
    cfg = _train_config(tmp_path, lora_target_modules=["q_proj", "v_proj", "experts"])
    trainer = Trainer(cfg)
    targets = ("experts.gate_up_proj", "experts.down_proj")
    for name in targets:
        assert isinstance(base_linear(trainer.trained_model(), name).kernel.get_value(), MXFP4)
    frozen_bytes = sum(np.dtype(x.dtype).itemsize * x.size for x in
                       jax.tree.leaves(trainer.frozen))
    assert trainer.memory_plan.weights == frozen_bytes
    trainer.train()
    losses = [r["loss"] for r in trainer.metrics.history if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    summary = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "base experts kept packed in MXFP4 (4.25 bits per value) as the frozen LoRA base" in summary
    for name in targets:
        assert isinstance(base_linear(trainer.trained_model(), name).kernel.get_value(), MXFP4)
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("kw, keep, why", [
    (dict(), True, "frozen LoRA base"),
    (dict(lora=False), False, "full fine-tuning trains them"),
    (dict(merge_adapter=True), False, "merge_adapter folds the adapter into them"),
])
def test_experts_stay_packed_only_where_frozen(tmp_path, kw, keep, why):
    """The decision and its line: packed for LoRA; full fine-tuning and merge_adapter get float experts."""
    from surojax.train.model_setup import load_base_model

    spec = run_spec(_train_config(tmp_path, **kw), total_steps=1)
    packed = spec.model.packed_experts
    assert (packed.keep, packed.why) == (keep, why)
    model = load_base_model(spec)
    kernel = model.layers.mlp.experts.gate_up_proj.kernel.get_value()
    assert isinstance(kernel, MXFP4) == keep
    if not keep:
        assert kernel.dtype == spec.precision.base
        assert packed.describe(spec.precision.base) == f"experts MXFP4 dequantised to float32 at load: {why}"


def test_serving_engine_decodes_over_the_packed_experts():
    """What `surojax serve` / `generate` load (load_model_ref with keep_quantized): the experts packed; the
    continuous-batching engine's greedy tokens are transformers' (the fixture's 32, from its bf16 form)."""
    from surojax.model_loader import load_model_ref
    from surojax.serve.engine import Engine
    from tests.serve.configs import BUCKETS, engine_config

    exp = np.load(CHECKPOINT / "expected.npz")
    model = load_model_ref(str(CHECKPOINT), attention="xla", keep_quantized=True).model
    assert isinstance(model.layers.mlp.experts.down_proj.kernel.get_value(), MXFP4)
    engine = Engine(model, engine_config(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                         max_model_len=48, buckets=BUCKETS))
    assert engine.generate([exp["greedy_prompt"].tolist()], max_tokens=32) == [exp["greedy_tokens"].tolist()]
