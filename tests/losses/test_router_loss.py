"""Router losses from the stacked RouterStats against a numpy transcription of transformers'
`load_balancing_loss_func` (qwen3_moe / mixtral, attention-mask branch) and of the ST-MoE z-loss, computed from
the raw router logits; and the LM loss's router term in the sum-of-tokens convention."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.losses.lm import lm_loss
from surojax.losses.router import RouterLossWeights, expert_load, load_balancing_loss, router_z_loss
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.layers.moe import route, router_stats

E, K, L, X = 6, 2, 3, 10
TINY_MOE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "router_aux_loss_coef": 0.25}


def hf_load_balancing_loss(gate_logits, top_k, mask):
    """transformers 5.17 qwen3_moe load_balancing_loss_func, attention_mask given, in numpy."""
    num_experts = gate_logits[0].shape[-1]
    counts, probs, rows = np.zeros(num_experts), np.zeros(num_experts), 0.0
    for logits in gate_logits:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        selected = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
        np.add.at(counts, selected.reshape(-1), np.repeat(mask, top_k))
        probs += (p * mask[:, None]).sum(0)
        rows += mask.sum()
    return num_experts * np.sum((counts / rows) * (probs / rows))


def stacked_stats(logits, segment_ids):
    moe = ModelConfig.from_hf(TINY_MOE).moe.__class__(num_experts=E, experts_per_token=K, expert_intermediate_size=4)
    per_layer = []
    for lg in logits:
        lg = jnp.asarray(lg)
        _, ids, probs = route(lg, moe)
        per_layer.append(router_stats(lg, probs, ids, jnp.ones((X * K,), bool), segment_ids, E))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def test_load_balancing_and_z_loss_match_the_references():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(L, X, E)).astype(np.float32) * 2
    segment_ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0]])  # three padding tokens left out
    mask = np.asarray(segment_ids).reshape(-1) != 0
    stats = stacked_stats(logits, segment_ids)
    np.testing.assert_allclose(float(load_balancing_loss(stats)),
                               hf_load_balancing_loss(list(logits), K, mask.astype(np.float64)), rtol=1e-5)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))  # [L, X]
    np.testing.assert_allclose(float(router_z_loss(stats)), np.mean((lse ** 2)[:, mask].mean(-1)), rtol=1e-5)
    load = np.asarray(expert_load(stats))
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)


def test_an_even_router_gives_k():
    logits = np.zeros((L, X, E), np.float32)  # uniform probabilities, top-k ties broken by index
    stats = stacked_stats(logits, jnp.ones((1, X), jnp.int32))
    # counts all on experts 0..k-1, probabilities even: E * sum_e (c_e/N)(1/E) = sum_e c_e / N = k
    np.testing.assert_allclose(float(load_balancing_loss(stats)), K, rtol=1e-6)


def test_lm_loss_adds_coef_times_aux_per_supervised_token():
    model = Decoder(ModelConfig.from_hf(TINY_MOE), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 8)))
    batch = {"tokens": tokens, "positions": jnp.tile(jnp.arange(8), (2, 1)), "segment_ids": jnp.ones((2, 8), jnp.int32),
             "targets": jnp.roll(tokens, -1, 1), "loss_mask": jnp.asarray(rng.random((2, 8)) < 0.7)}
    ce, aux0 = nnx.jit(lm_loss)(model, batch)
    w = RouterLossWeights(aux_coef=0.25, z_coef=0.01)
    total, aux = nnx.jit(lambda m, b: lm_loss(m, b, router=w))(model, batch)
    stats = aux["router"]
    assert stats.expert_counts.shape == (2, 4) and float(aux["tokens"]) == float(aux0["tokens"])
    expected = ce + (0.25 * load_balancing_loss(stats) + 0.01 * router_z_loss(stats)) * aux["tokens"]
    np.testing.assert_allclose(float(total), float(expected), rtol=1e-6)
    assert float(load_balancing_loss(stats)) > 0 and float(total) > float(ce)
    # the aux term has a gradient to the router kernel
    g = nnx.jit(nnx.grad(lambda m: lm_loss(m, batch, router=RouterLossWeights(aux_coef=1.0))[0]
                         - lm_loss(m, batch)[0]))(model)
    assert float(jnp.abs(g.layers.mlp.router.kernel[...]).max()) > 0
