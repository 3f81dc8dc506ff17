"""fuse_projections (serving): q / k / v, gate / up and a Gated DeltaNet's four input projections joined into one
GEMM each compute the logits of the parts, in every layer stack of a hybrid; plain kernels and LaidOut weights of one layout join, anything else is left as it is.

Tolerance. The joined kernel holds the same values; a column's dot product is the same sum, up to the order the
GEMM's blocking gives it (fp32 here): tests/tolerances.py's reorder bound for the longest sum (the MLP's F = 512),
at the logits' scale. A joined kernel that put a column in the wrong place would be off by O(the logits)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.kernel_settings import use_kernel_settings
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.fused_projections import fuse_projections
from surojax.peft.lora import apply_lora
from surojax.quant.model import quantize_model
from surojax.quant.laid_out import LaidOut, lay_out_model
from tests.tolerances import reorder_atol

HF = {"vocab_size": 128, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
TOKENS = jnp.asarray([[3, 17, 99, 120, 7, 42, 1, 100]])
LONGEST_SUM = HF["intermediate_size"]  # the down projection's K


def _model(model_type, seed=0):
    model = Decoder(ModelConfig.from_hf({"model_type": model_type, **HF}), rngs=nnx.Rngs(params=seed))
    if model.layers.attn.q_proj.bias is not None:  # qwen2: give the zero-initialised biases values
        for name in ("q_proj", "k_proj", "v_proj"):
            b = getattr(model.layers.attn, name).bias
            b.set_value(jax.random.normal(jax.random.key(len(name)), b.get_value().shape, b.get_value().dtype))
    return model


def _logits(model):
    return np.asarray(jax.jit(lambda m, t: m(t))(model, TOKENS))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])  # qk-norm; q / k / v biases
def test_joined_projections_give_the_same_logits(model_type):
    model = _model(model_type)
    want = _logits(model)
    assert fuse_projections(model) == ["qkv_proj", "gate_up_proj"]
    attn, mlp = model.layers.attn, model.layers.mlp
    assert attn.q_proj is None and attn.k_proj is None and attn.v_proj is None and mlp.gate_proj is None
    assert attn.qkv_proj.kernel.get_value().shape == (2, 256, (4 + 2 * 2) * 64)
    assert mlp.gate_up_proj.kernel.get_value().shape == (2, 256, 2 * 512)
    assert (attn.qkv_proj.bias is None) == (model_type == "qwen3")
    np.testing.assert_allclose(_logits(model), want, rtol=0,
                               atol=reorder_atol(LONGEST_SUM, np.float32, np.abs(want).max()))
    assert fuse_projections(model) == []  # idempotent


def test_laid_out_weights_join_and_mixed_formats_stay_apart():
    """Plain weights laid out for the decode kernel join as one LaidOut (same values through the kernel's decode
    form, interpret mode); q / k fp32 next to a q4_k v cannot join, gate / up still do."""
    model = _model("qwen3", seed=1)
    want = _logits(model)
    lay_out_model(model, frozenset({"float32"}))
    assert fuse_projections(model) == ["qkv_proj", "gate_up_proj"]
    joined = model.layers.attn.qkv_proj.kernel.get_value()
    assert isinstance(joined, LaidOut) and joined.shape == (256, 512) and joined.data.shape == (2, 256, 512)
    with use_kernel_settings(quant_matmul="pallas"):
        np.testing.assert_allclose(_logits(model)[:, :1], want[:, :1], rtol=0,
                                   atol=reorder_atol(LONGEST_SUM, np.float32, np.abs(want).max()))

    mixed = _model("qwen3", seed=1)
    quantize_model(mixed, "q4_k", targets=("v_proj",))
    lay_out_model(mixed, frozenset({"*", "float32"}))
    assert fuse_projections(mixed) == ["gate_up_proj"] and mixed.layers.attn.q_proj is not None


def test_lora_wrapped_projections_are_left_alone():
    model = _model("qwen3")
    apply_lora(model, targets=("q_proj", "gate_proj"), rank=4, alpha=8, rngs=nnx.Rngs(params=3))
    assert fuse_projections(model) == []


def test_hybrid_joins_every_stack():
    """Qwen3.5's two stacks: the attention layers' q / k / v and gate / up, the DeltaNet layers' gate / up and
    in_proj_qkv / z / b / a (split back by width: a column in the wrong part would move the logits by O(1))."""
    hf = {"model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    model = Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(params=2))
    want = _logits(model)
    assert fuse_projections(model) == ["qkv_proj", "gate_up_proj", "in_proj_qkvzba"]
    la = model.linear_layers.linear_attn
    assert la.in_proj_qkv is None and la.in_proj_a is None and model.linear_layers.mlp.gate_proj is None
    assert la.in_proj_qkvzba.kernel.get_value().shape == (3, 64, (2 * 2 * 16 + 4 * 8) + 4 * 8 + 2 * 4)
    np.testing.assert_allclose(_logits(model), want, rtol=0,
                               atol=reorder_atol(128, np.float32, np.abs(want).max()))
