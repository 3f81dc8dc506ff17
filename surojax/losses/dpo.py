"""Direct preference optimisation (DPO, Rafailov et al. 2023) as pure functions, with TRL's definitions.

A batch holds P pairs, each two sequences sharing a prompt: arrays [P, 2, T] (index 0 = chosen, 1 = rejected)
under the batch contract of surojax/data/batch.py, loss_mask 1 on the response tokens only. A sequence's log-prob
is the SUM over its response tokens of log p(token | prefix) (TRL's `concatenated_forward`); for `ipo` it is the
MEAN over the response tokens (TRL divides by the response length for IPO, after the IPO paper).

With h = (pi_c - pi_r) - (ref_c - ref_r) (reference_free: ref = 0), per pair:

    sigmoid   -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)     (eps = label_smoothing: cDPO)
    hinge     relu(1 - beta * h)                                                    (SLiC)
    ipo       (h - 1 / (2 * beta))^2

rewards/chosen = beta * (pi_c - ref_c), rewards/rejected = beta * (pi_r - ref_r) (no gradient), margins their
difference, accuracy = chosen reward > rejected reward. At the start policy == reference, h = 0 and the sigmoid
loss is ln 2.

The reference log-probs come from the batch (`ref_logps` [P, 2]: sums, precomputed in one pass over the data
before full fine-tuning) or, for a LoRA / QLoRA model without them, from the same model with its adapters
disabled (`without_adapter`: surojax.peft.lora.adapters_disabled, passed in by the trainer) under stop_gradient in
the same call: no second copy of the weights.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal

import jax
import jax.numpy as jnp

from surojax.losses.lm import DEFAULT_CHUNK_TOKENS
from surojax.losses.router import RouterLossWeights, collected, router_loss
from surojax.losses.token_logps import model_target_logps, target_logps

DPOLossType = Literal["sigmoid", "ipo", "hinge"]
LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")
METRIC_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """The DPO keys of a run (surojax/config/dpo.py), as the loss reads them."""

    beta: float = 0.1
    loss_type: DPOLossType = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError(f"beta must be positive, got {self.beta}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("label_smoothing (cDPO) applies to loss_type sigmoid only")

    @property
    def averages_tokens(self) -> bool:
        """Whether sequence log-probs are means over response tokens (ipo) rather than sums."""
        return self.loss_type == "ipo"


def sequence_logps(model, seqs: dict, *, chunk: int = DEFAULT_CHUNK_TOKENS, router_stats: bool = False):
    """Sums over the response tokens of log p(token): seqs' arrays [..., T] -> [...] fp32 (the model runs on
    them flattened to [N, T]; surojax.losses.token_logps). With `router_stats` (a MoE model): (sums, the layers'
    RouterStats [L, ...] over the N sequences)."""
    lead, T = seqs["tokens"].shape[:-1], seqs["tokens"].shape[-1]
    flat = {k: seqs[k].reshape(-1, T) for k in ("tokens", "positions", "segment_ids", "targets", "loss_mask")}
    mask = flat["loss_mask"].astype(jnp.float32)
    if not router_stats:
        lp = model_target_logps(model, flat, chunk=chunk)  # [N, T]
        return jnp.sum(lp * mask, axis=-1).reshape(lead)
    h, _, stats = model.hidden_states(flat["tokens"], flat["positions"], flat["segment_ids"])  # [N, T, D]
    stats = collected(stats)
    lp = target_logps(h, model.head_weight(), flat["targets"], chunk=chunk,
                      softcap=model.cfg.final_logit_softcapping)  # [N, T]
    return jnp.sum(lp * mask, axis=-1).reshape(lead), stats


def pair_losses(policy: jax.Array, reference: jax.Array, settings: DPOSettings) -> tuple[jax.Array, dict]:
    """policy / reference log-probs [P, 2] (chosen, rejected) -> (loss per pair [P], metrics per pair [P] each).
    `reference` is ignored with reference_free."""
    ref = jnp.zeros_like(reference) if settings.reference_free else reference
    beta = settings.beta
    h = (policy[:, 0] - policy[:, 1]) - (ref[:, 0] - ref[:, 1])  # [P]
    if settings.loss_type == "sigmoid":
        eps = settings.label_smoothing
        loss = -(1.0 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
    elif settings.loss_type == "hinge":
        loss = jax.nn.relu(1.0 - beta * h)
    else:  # ipo
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    rewards = jax.lax.stop_gradient(beta * (policy - ref))  # [P, 2]
    metrics = {"rewards/chosen": rewards[:, 0], "rewards/rejected": rewards[:, 1],
               "rewards/margins": rewards[:, 0] - rewards[:, 1],
               "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)}
    return loss, metrics


def dpo_loss(model, batch: dict, *, settings: DPOSettings,
             without_adapter: Callable[[object], AbstractContextManager] | None = None,
             chunk: int = DEFAULT_CHUNK_TOKENS, router: RouterLossWeights | None = None) -> tuple[jax.Array, dict]:
    """The DPO loss of a micro-batch of pairs (arrays [P, 2, T]; optional `ref_logps` [P, 2] sums).
    The reference: none with reference_free, else `ref_logps`, else the model inside `without_adapter(model)`.

    Returns (sum of the pair losses, {"tokens": number of real pairs, and METRIC_KEYS: sums over the pairs}):
    the step divides the loss by the pairs; the trainer divides the reward sums. A padding pair (no response
    token) weighs 0. Chosen and rejected run through the model as one batch of 2P sequences.
    `router` (a MoE policy): the policy forward's router losses (surojax.losses.router, over the 2P sequences'
    tokens) join the sum weighted by the pairs, so one micro-batch gives `dpo_loss + router_aux_loss_coef * aux`
    (TRL's DPOTrainer adds the same with `output_router_logits`); aux["router"] holds the layers' RouterStats.
    The reference forward adds no router loss."""
    lengths = jnp.sum(batch["loss_mask"].astype(jnp.float32), axis=-1)  # [P, 2]
    real = (lengths[:, 0] > 0).astype(jnp.float32)  # [P]
    run = dict(chunk=chunk)
    stats = None
    if router is None:
        policy = sequence_logps(model, batch, **run)  # [P, 2]
    else:
        if model.cfg.moe is None:
            raise ValueError("router losses need a mixture-of-experts model; this one is dense")
        policy, stats = sequence_logps(model, batch, **run, router_stats=True)
    if settings.reference_free:
        reference = jnp.zeros_like(policy)
    elif "ref_logps" in batch:
        reference = batch["ref_logps"].astype(jnp.float32)
    elif without_adapter is not None:
        with without_adapter(model):
            reference = jax.lax.stop_gradient(sequence_logps(model, batch, **run))
    else:
        raise ValueError("DPO needs reference log-probs: `ref_logps` in the batch (full fine-tuning), "
                         "without_adapter (LoRA: the base is the reference) or reference_free")
    if settings.averages_tokens:
        denom = jnp.maximum(lengths, 1.0)
        policy, reference = policy / denom, reference / denom
    loss, metrics = pair_losses(policy, reference, settings)
    metrics = {k: jnp.sum(v * real) for k, v in metrics.items()}
    total, pairs = jnp.sum(loss * real), jnp.sum(real)
    if stats is None:
        return total, {"tokens": pairs, **metrics}
    total = total + router_loss(stats, router) * pairs
    return total, {"tokens": pairs, **metrics, "router": jax.lax.stop_gradient(stats)}
