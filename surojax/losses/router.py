"""Router losses of a mixture-of-experts model, as pure functions of its stacked `RouterStats` ([L, ...]).

    load_balancing_loss   Switch Transformer / Qwen form, exactly transformers' `load_balancing_loss_func`
                          (qwen3_moe, mixtral): with counts and probabilities summed over ALL layers and
                          N = layers x real tokens,
                              aux = E * sum_e (counts_e / N) * (prob_sums_e / N)
                          counts_e: top-k assignments to expert e (k per token, so sum_e counts_e / N = k);
                          prob_sums_e: the router's softmax probability of e summed over tokens. A perfectly even
                          router gives aux = k. Padding (segment id 0) is left out, as HF leaves out attention_mask 0.
    router_z_loss         ST-MoE: the mean over real tokens of logsumexp(router logits)^2, averaged over layers.

Gradients: the counts come from a top-k selection and carry none; the aux loss reaches trainable parameters only
through the router probabilities, i.e. the router kernel (and, through the router's input, every weight below
it). So it matters where the router or the layers under it train: `train_router: true` with LoRA, or a full
fine-tune; with LoRA on attention / experts alone it still shapes the adapters below each router, weakly.

`RouterLossWeights` is what the LM loss adds: `aux_coef * aux + z_coef * z` per supervised token of the
micro-batch (surojax.losses.lm), so one micro-batch gives HF's `loss + router_aux_loss_coef * aux_loss`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from surojax.models.layers.moe import RouterStats


@dataclasses.dataclass(frozen=True)
class RouterLossWeights:
    """Coefficients of the router losses in the training loss (0 leaves a term out)."""

    aux_coef: float = 0.0  # load-balancing loss (HF `router_aux_loss_coef`)
    z_coef: float = 0.0  # router z-loss


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """stats stacked on [L] (expert_counts / prob_sums [L, E], tokens [L]) -> the scalar aux loss (fp32)."""
    counts = jnp.sum(stats.expert_counts, axis=0)  # [E] over all layers
    probs = jnp.sum(stats.prob_sums, axis=0)  # [E]
    n = jnp.maximum(jnp.sum(stats.tokens), 1.0)  # layers x real tokens
    num_experts = counts.shape[-1]
    return num_experts * jnp.sum((counts / n) * (probs / n))


def router_z_loss(stats: RouterStats) -> jax.Array:
    """stats stacked on [L] (z_sum [L], tokens [L]) -> mean over layers of the per-token mean logsumexp^2."""
    per_layer = stats.z_sum / jnp.maximum(stats.tokens, 1.0)  # [L]
    return jnp.mean(per_layer)


def router_loss(stats: RouterStats, weights: RouterLossWeights) -> jax.Array:
    """aux_coef * load_balancing_loss + z_coef * router_z_loss (a term with coefficient 0 is not computed)."""
    total = jnp.zeros((), jnp.float32)
    if weights.aux_coef:
        total = total + weights.aux_coef * load_balancing_loss(stats)
    if weights.z_coef:
        total = total + weights.z_coef * router_z_loss(stats)
    return total


def expert_load(stats: RouterStats) -> jax.Array:
    """The fraction of each layer's assignments that went to each expert: [L, E], each row sums to 1 (0 for a
    layer that saw no token). An even router gives 1 / E everywhere."""
    counts = stats.expert_counts
    return counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)


def collected(stats):
    """The router statistics a forward pass returned (`HiddenStates.router_stats`), refused when its layer runner
    collected none (the prefetching and the pipelined runners do not)."""
    if stats is None:
        raise ValueError("router losses need the layers' router statistics; this layer runner collects none "
                         "(offload_prefetch and pipeline stages do not)")
    return stats
