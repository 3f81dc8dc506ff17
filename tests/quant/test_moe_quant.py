"""Quantised MoE experts: `grouped_matmul` of every format and the gathered few-rows form against a per-row
reference, the qlora transform on a MoE model, and a QLoRA training step over quantised experts (qwen3_moe, and the
Qwen3.5 MoE hybrid)."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pallas_kernels.grouped_matmul import gathered_dot
from surojax.models.config import ModelConfig, MoEConfig
from surojax.models.decoder import Decoder
from surojax.peft.lora import TRAINABLE, apply_lora
from surojax.quant.model import dequantize_model, is_quantized, quantize_model
from surojax.quant.transform import quantize_stacked

from tests.train.conftest import ROOT

E, K, N = 3, 256, 64  # K = 256: a Q4_K super-block


@pytest.mark.parametrize("fmt", ["nf4", "fp8", "q4_k"])
def test_grouped_matmul_matches_per_row_reference(fmt):
    w = jax.random.normal(jax.random.key(0), (E, K, N)) * 0.05
    q = quantize_stacked(w, fmt)  # leaves [E, ...]
    group_sizes = jnp.array([3, 0, 2], jnp.int32)  # an empty expert; 2 trailing rows past the groups
    x = jax.random.normal(jax.random.key(1), (7, K))
    got = np.asarray(q.grouped_matmul(x, group_sizes))
    deq = np.stack([np.asarray(quantize_stacked(w[e], fmt).dequantize(jnp.float32)) for e in range(E)])  # [E, K, N]
    row_expert = [0, 0, 0, 2, 2]
    want = np.zeros((7, N), np.float32)
    for r, e in enumerate(row_expert):
        want[r] = np.asarray(x[r]) @ deq[e]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(deq - np.asarray(w)).max() > 0  # really quantised


@pytest.mark.parametrize("fmt,options", [("nf4", {"double_quant": True}), ("fp8", {}), ("q4_k", {}), ("mxfp4", {})])
def test_gathered_dot_reads_the_routed_experts_blocks(fmt, options):
    """The few-rows MoE form on quantised experts: each row against its expert's dequantised weight (per-row
    reference, experts repeated and out of order), from the gathered packed blocks alone (A experts' bytes)."""
    w = jax.random.normal(jax.random.key(0), (E, K, N)) * 0.05
    q = quantize_stacked(w, fmt, **options)  # leaves [E, ...]
    ids = jnp.array([2, 0, 2, 1, 2], jnp.int32)
    x = jax.random.normal(jax.random.key(1), (5, K))
    got = np.asarray(jax.jit(gathered_dot)(x, q, ids))
    deq = np.asarray(q.dequantize(jnp.float32))  # [E, K, N]
    want = np.stack([np.asarray(x[r]) @ deq[e] for r, e in enumerate(np.asarray(ids))])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    taken = q.take_experts(ids)
    assert type(taken) is type(q) and taken.nbytes * E == q.nbytes * len(ids)  # the routed experts' bytes only


CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, moe=MoEConfig(4, 2, 64, norm_topk_prob=True))
TOKENS = jnp.array([[1, 5, 9, 33, 2, 17, 60, 8], [4, 4, 21, 0, 63, 12, 7, 30]], jnp.int32)


def test_qlora_reaches_the_experts_not_the_router():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    quantize_model(model, "nf4", double_quant=True)
    assert is_quantized(model) == {t: "nf4" for t in ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj",
                                                       "experts.down_proj")}
    assert model.layers.mlp.experts.gate_up_proj.kernel.get_value().data.shape[:2] == (2, 4)  # [L, E, packed]
    assert isinstance(model.layers.mlp.router.kernel.get_value(), jax.Array)  # the router stays a plain weight
    # quantised experts: a decode step's MoE gathers up to E * GATHER_CROSSOVER_QUANTISED assignments
    assert model.layers.mlp.experts.quantised() and not Decoder(CFG, rngs=nnx.Rngs(0)).layers.mlp.experts.quantised()


def test_qlora_step_on_quantised_experts_reduces_the_loss():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    quantize_model(model, "nf4")
    apply_lora(model, targets="all-linear", rank=4, alpha=8, rngs=nnx.Rngs(1))
    graphdef, lora, rest = nnx.split(model, TRAINABLE, ...)
    opt = optax.adam(1e-2)
    opt_state = opt.init(lora)

    def loss_fn(lora):
        logits = nnx.merge(graphdef, lora, rest)(TOKENS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    @jax.jit
    def step(lora, opt_state):
        loss, g = jax.value_and_grad(loss_fn)(lora)
        updates, opt_state = opt.update(g, opt_state)
        return optax.apply_updates(lora, updates), opt_state, loss

    losses = []
    for _ in range(6):
        lora, opt_state, loss = step(lora, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses
    expert_b = nnx.to_pure_dict(lora)["layers"]["mlp"]["experts"]["down_proj"]["lora_b"]
    assert float(jnp.abs(expert_b).max()) > 0  # the expert adapters were trained, through the quantised GEMM


# the Qwen3.5 MoE hybrid (the qwen3_5_moe_text fixture's widths, two layers: a Gated DeltaNet layer and a gated
# attention layer, each with the sparse MoE + the shared expert and its gate)
HYBRID = ModelConfig.from_hf({**json.loads((ROOT / "tests/fixtures/models/qwen3_5_moe_text/config.json").read_text()),
                              "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})
_HYBRID_MOE = ("experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
               "shared_expert.down_proj")
HYBRID_QUANTISED = (("q_proj", "k_proj", "v_proj", "o_proj") + _HYBRID_MOE  # site keys: `layers`, `linear_layers.*`
                    + tuple("linear_layers." + t for t in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                          "out_proj") + _HYBRID_MOE))


def _hybrid_with_adapter(quant: bool):
    """The hybrid (same weights every call), NF4 (double-quantised) when `quant`, LoRA on all-linear with B != 0
    (drawn the same every call: the same adapter on every base)."""
    model = Decoder(HYBRID, rngs=nnx.Rngs(0))
    if quant:
        quantize_model(model, "nf4", double_quant=True)
    apply_lora(model, targets="all-linear", rank=4, alpha=8, rngs=nnx.Rngs(1))
    rs = np.random.RandomState(7)
    for path, var in nnx.to_flat_state(nnx.state(model, TRAINABLE)):
        if path[-1] == "lora_b":
            var.set_value(jnp.asarray(0.1 * rs.randn(*var.get_value().shape), jnp.float32))
    return model


def _hybrid_loss(lora, graphdef, rest, tokens):
    logits = nnx.merge(graphdef, lora, rest)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_qlora_step_on_the_moe_hybrid():
    """QLoRA over an NF4 base of qwen3_5_moe_text: every projection of both stacks (attention, DeltaNet, routed and
    shared experts) is quantised, the routers and the shared-expert gate stay plain; the LoRA step's loss and
    adapter gradients equal those over the dequantised base (the same function in fp32: the quantised matmuls are
    right), and its loss is close to the unquantised base's (NF4's rounding only)."""
    model = _hybrid_with_adapter(quant=True)
    assert is_quantized(model) == {t: "nf4" for t in HYBRID_QUANTISED}
    for stack in (model.layers, model.linear_layers):
        assert isinstance(stack.mlp.router.kernel.get_value(), jax.Array)
        assert isinstance(stack.mlp.shared_expert_gate.kernel.get_value(), jax.Array)
    reference = _hybrid_with_adapter(quant=True)
    dequantize_model(reference, jnp.float32)
    plain = _hybrid_with_adapter(quant=False)
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, HYBRID.vocab_size)
    step = jax.jit(jax.value_and_grad(_hybrid_loss), static_argnums=1)  # plain and dequantised: one compilation

    def loss_and_grads(m):
        graphdef, lora, rest = nnx.split(m, TRAINABLE, ...)
        return step(lora, graphdef, rest, tokens)

    (loss, grads), (deq_loss, deq_grads), (plain_loss, _) = map(loss_and_grads, (model, reference, plain))
    np.testing.assert_allclose(float(loss), float(deq_loss), rtol=1e-5)
    for (path, g), d in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(deq_grads), strict=True):
        assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)  # every adapter of both stacks trains
        np.testing.assert_allclose(g, d, rtol=1e-4, atol=1e-4 * float(jnp.abs(d).max()),
                                   err_msg=jax.tree_util.keystr(path))
    assert abs(float(loss) - float(plain_loss)) < 0.02 * float(plain_loss) and float(loss) != float(plain_loss)
