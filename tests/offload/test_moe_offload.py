"""Offload on a MoE model: the frozen base (the experts are its bulk) streamed from host memory one layer per scan
step computes exactly what the resident base computes, LoRA on attention (logits, loss, LoRA gradients); and the
memory plan counts every expert's weights and the [A, 2F] expert rows (A = tokens * k) of the activations."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.losses.lm import lm_loss
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.offload.memory_plan import activation_bytes_per_token_layer, plan_memory
from surojax.models.layer_runner import LayerScan, Recompute, with_runner
from surojax.offload.streaming import HOST_KIND, check_streamed, place_base_on_host, streamed_leaves

TINY = ModelConfig.from_hf(dict(model_type="qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True))
# Qwen3-30B-A3B's shapes
A3B = ModelConfig.from_hf(dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768))


def test_streamed_moe_base_equals_resident():
    """The embedding is the trainable part here (its gradient runs back through every streamed layer's
    recomputation); LoRA on a MoE model comes with the LoRA-on-experts branch, a trainable variable set like
    this one to the streaming."""
    model = Decoder(TINY, rngs=nnx.Rngs(0))
    trainable_filter = nnx.All(nnx.Param, nnx.PathContains("embed"))
    graphdef, trainable, resident = nnx.split(model, trainable_filter, ...)
    streamed = place_base_on_host(resident, embedding=False)
    assert check_streamed(streamed) > 0
    kinds = streamed_leaves(streamed)
    assert set(kinds.values()) == {HOST_KIND} and any("experts" in str(k) for k in kinds)
    rng = np.random.default_rng(0)
    mb = {"tokens": rng.integers(1, 128, (2, 16)).astype(np.int32),
          "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)).copy(),
          "segment_ids": np.ones((2, 16), np.int32), "targets": rng.integers(1, 128, (2, 16)).astype(np.int32),
          "loss_mask": np.ones((2, 16), np.float32)}
    loop = LayerScan(Recompute.FULL)

    def run(tr, fr):
        logits = nnx.merge(graphdef, tr, fr)(mb["tokens"], mb["positions"], mb["segment_ids"])
        loss, grads = jax.value_and_grad(lambda t: lm_loss(with_runner(nnx.merge(graphdef, t, fr), loop), mb)[0])(tr)
        return logits, loss, grads

    (lg_s, l_s, g_s), (lg_r, l_r, g_r) = jax.jit(lambda tr, s, r: (run(tr, s), run(tr, r)))(
        trainable, streamed, resident)
    assert float(jnp.max(jnp.abs(lg_s - lg_r))) == 0.0 and float(l_s) == float(l_r)
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_r)):
        assert float(jnp.max(jnp.abs(a - b))) == 0.0 and float(jnp.max(jnp.abs(a))) > 0


def test_memory_plan_counts_every_expert_and_the_expert_rows():
    # weights: the bf16 base of all 128 experts (~30.5 B parameters), not the active ~3.3 B
    plan = plan_memory(A3B, batch=1, seq=2048, recompute=Recompute.DOTS, targets=("q_proj",), rank=16)
    assert plan.weights == 2 * A3B.num_params() and A3B.num_params() > 30e9
    # dots, per token and layer: input 2048, q/k/v 4096 + 2 * 512, o_proj 2048 (bf16); router logits 128 fp32;
    # k = 8 expert rows of gate_up 2 * 768 and down 2048 (bf16) -- not the unused dense intermediate_size 6144
    per = 2 * (2048 + 4096 + 1024 + 2048) + 4 * 128 + 8 * 2 * (2 * 768 + 2048)
    assert activation_bytes_per_token_layer(A3B, Recompute.DOTS, c=2) == per == 76288
    # LoRA on the experts' projections: one adapter per expert (A [E, D, R], B [E, R, F] for gate_proj)
    lora = plan_memory(A3B, batch=1, seq=2048, recompute=Recompute.FULL, targets=("gate_proj",), rank=16)
    assert lora.adapters == 48 * 128 * 16 * (2048 + 768) * 4
