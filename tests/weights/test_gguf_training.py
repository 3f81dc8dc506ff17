"""Training over GGUF: `model: file.gguf` trains LoRA over the file's quantised kernels (kept in their GGUF format,
tokenizer from the metadata); LoRA gradients over the quantised base equal those over its dequantised copy;
`qlora_gguf: q4_k_m` quantises an HF base with llama.cpp's mix (one type per target)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("gguf")

from surojax.config import config_from_dict  # noqa: E402
from surojax.peft.lora import LORA_TARGETS, base_linear  # noqa: E402
from surojax.quant import Q8_0  # noqa: E402
from surojax.quant.model import dequantize_model, is_quantized  # noqa: E402
from surojax.train.model_setup import build_model as build_spec_model
from surojax.train.run_spec import TrainSetupError, run_spec  # noqa: E402
from surojax.train.trainer import Trainer  # noqa: E402
from surojax.weights.gguf_checkpoint import save_gguf  # noqa: E402

from surojax.data.tokenizer import Tokenizer  # noqa: E402

from tests.train.conftest import TOKENIZER, write_instruction_data  # noqa: E402
from tests.weights.gguf_tiny import PROMPT_IDS, tiny_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_train")
    hf_dir = tiny_model_dir("qwen3", root / "qwen3")
    return hf_dir, save_gguf(hf_dir, root / "qwen3-q8_0.gguf", "q8_0"), save_gguf(hf_dir, root / "q4km.gguf", "q4_k_m")


def build_model(cfg):
    return build_spec_model(run_spec(cfg, total_steps=1))


def _cfg(tmp_path, model, **kw):
    return config_from_dict(dict(
        model=str(model), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none", lora=True,
        lora_rank=4, lora_alpha=8, datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl")),
                                                "type": "instruction"}],
        sequence_len=32, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-2,
        lr_scheduler_type="constant", max_steps=3, **kw))


def test_trainer_trains_lora_over_a_gguf_base(tmp_path, tiny):
    trainer = Trainer(_cfg(tmp_path, tiny[1]))
    assert (trainer.tokenizer_dir / "tokenizer.json").is_file()
    text = "What is 3 plus 4?<|im_end|>"
    assert trainer.tokenizer.encode(text) == Tokenizer.from_dir(TOKENIZER).encode(text)
    assert trainer.tokenizer.eos_token_id == 509
    for name in LORA_TARGETS:
        assert isinstance(base_linear(trainer.trained_model(), name).kernel.get_value(), Q8_0)
    trainer.train()
    losses = [r["loss"] for r in trainer.metrics.history if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    assert all(isinstance(base_linear(trainer.trained_model(), n).kernel.get_value(), Q8_0) for n in LORA_TARGETS)


def test_lora_grads_over_gguf_base_match_dequantised(tmp_path, tiny):
    """Same math: the gradient wrt the adapters over the kept-quantised Q4_K_M base (Q4_K, and Q4_K / Q6_K layers
    in one gguf_mixed weight for v / down) equals the one over the dequantised fp32 base (rtol 1e-4: only the
    order of fp32 operations differs)."""
    cfg = _cfg(tmp_path, tiny[2])
    quant = build_model(cfg)
    plain = build_model(cfg)
    dequantize_model(plain, jnp.float32)
    assert is_quantized(quant)["v_proj"] == "gguf_mixed" and not is_quantized(plain)
    ids = jnp.asarray([PROMPT_IDS])

    def grads(model):
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # make lora_b non-zero: a real gradient
            if p[-1] == "lora_b":
                v.set_value(jnp.full(v.get_value().shape, 0.01, v.get_value().dtype))

        def loss(lora, rest):
            m = nnx.merge(graphdef, lora, rest)
            logits = m(ids[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        return jax.jit(jax.grad(loss))(lora, rest)

    gq, gp = grads(quant), grads(plain)
    for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_qlora_gguf_mix_on_an_hf_base(tmp_path, tiny):
    model = build_model(_cfg(tmp_path, tiny[0], qlora_gguf="q4_k_m"))
    assert is_quantized(model) == {"q_proj": "q4_k", "k_proj": "q4_k", "v_proj": "q6_k", "o_proj": "q4_k",
                                   "gate_proj": "q4_k", "up_proj": "q4_k", "down_proj": "q6_k"}


def test_gguf_base_refuses_what_cannot_work(tmp_path, tiny):
    with pytest.raises(TrainSetupError, match="keeps its own quantization"):
        build_model(_cfg(tmp_path, tiny[1], qlora_gguf="q4_k"))
    with pytest.raises(TrainSetupError, match="merge_adapter cannot fold"):
        build_model(_cfg(tmp_path, tiny[1], merge_adapter=True))
