"""GRPO policy loss as pure functions: group advantages, the clipped token loss, and the model-level loss.

Follows TRL's GRPOTrainer (`_generate_and_score_completions` for the advantages, `_compute_loss` for the loss) so
that the same rollouts give the same numbers:

    advantages = group_advantages(rewards [P*G], G, "group")            # [P*G]
    loss, metrics = grpo_token_loss(logps, old_logps, ref_logps, advantages, mask, loss_type="dapo", ...)
    loss_sum, aux = grpo_loss(model, batch, chunk=..., settings=GRPOLossSettings(...))

Per token t of completion i (R completions, T positions, mask [R, T] = 1 on the completion's tokens):

    ratio_it  = exp(logp_it - old_it)                  (gspo: one ratio per completion, exp(mean_t(logp - old)))
    loss_it   = -min(ratio_it * A_i, clip(ratio_it, 1 - epsilon, 1 + epsilon_high) * A_i) + beta * kl_it
    kl_it     = exp(ref_it - logp_it) - (ref_it - logp_it) - 1            (k3 estimator; only when beta > 0)

and the token losses are aggregated per `loss_type` (TRL):

    grpo, gspo  mean over completions of (sum_t loss_it * mask_it / max(1, sum_t mask_it))
    dr_grpo     sum_it loss_it * mask_it / (R * max_completion_length)
    dapo        sum_it loss_it * mask_it / sum_it mask_it

Gradient accumulation (surojax/train/step.py divides the summed `loss_sum` by the summed aux["tokens"]): TRL's
normalisations are per optimizer step, and they compose exactly with these (loss_sum, count) pairs:
grpo / gspo return (sum over rows of the row means, R), dr_grpo (sum / max_completion_length, R) and dapo
(token sum, completion tokens). Over A micro-batches of R rows the step's loss is then TRL's: grpo's mean of
micro-batch means equals the mean over all A*R rows (equal micro-batches), dr_grpo's sum / (A*R*L), and dapo's
division by the completion tokens of the whole step (TRL's `num_items_in_batch`). Every row counts as one
completion (also one whose mask is all zero, as in TRL): the batch holds no padding rows.

Shapes: R completions (rows), T positions (prompt + completion), D hidden, V vocabulary (surojax/models/config.py).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from surojax.losses.lm import DEFAULT_CHUNK_TOKENS
from surojax.losses.router import RouterLossWeights, collected, router_loss
from surojax.losses.token_logps import target_logps  # the policy's per-token log-probs (also imported from here)

LossType = Literal["grpo", "dr_grpo", "dapo", "gspo"]
ScaleRewards = Literal["group", "batch", "none"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo")
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)

# the summed aux keys of grpo_loss (besides "tokens") and what each mean metric divides by
METRIC_DENOMINATORS = {"kl": "completion_tokens", "clip_ratio/low_mean": "clip_count",
                       "clip_ratio/high_mean": "clip_count", "clip_ratio/region_mean": "clip_count"}


@dataclasses.dataclass(frozen=True)
class GRPOLossSettings:
    """The loss's static settings (TRL's GRPOConfig names). `epsilon_high` None means `epsilon`; `temperature`
    divides the logits before the log-softmax, as the rollouts were sampled (TRL does the same)."""

    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    max_completion_length: int = 256
    temperature: float = 1.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.max_completion_length <= 0 or self.temperature <= 0:
            raise ValueError("max_completion_length and temperature must be positive")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# ---- advantages -------------------------------------------------------------------------------------------------

def _nanmean(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    valid = ~jnp.isnan(x)
    n = jnp.sum(valid, axis=axis, keepdims=keepdims)
    s = jnp.sum(jnp.where(valid, x, 0.0), axis=axis, keepdims=keepdims)
    return jnp.where(n > 0, s / jnp.maximum(n, 1), jnp.nan)


def _nanstd(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """Bessel-corrected std over the non-NaN values (NaN with fewer than two): TRL's `nanstd`."""
    valid = ~jnp.isnan(x)
    n = jnp.sum(valid, axis=axis, keepdims=True)
    mean = _nanmean(x, axis=axis, keepdims=True)
    ss = jnp.sum(jnp.where(valid, (x - mean) ** 2, 0.0), axis=axis, keepdims=True)
    std = jnp.where(n > 1, jnp.sqrt(ss / jnp.maximum(n - 1, 1)), jnp.nan)
    return std if keepdims else jnp.squeeze(std, axis=axis)


def group_advantages(rewards: jax.Array, num_generations: int, scale_rewards: ScaleRewards) -> jax.Array:
    """rewards [P*G] (the G completions of a prompt adjacent; NaN: unscorable) -> advantages [P*G] fp32.

    advantage = reward - mean of its group, divided by (std + 1e-4) where std is the group's (`group`) or the whole
    batch's (`batch`) Bessel-corrected std, undivided for `none`. NaN rewards are left out of the means and stds;
    their advantage, and that of a group with a single scorable reward under `group`, is 0 (TRL)."""
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards: {scale_rewards!r} is not one of group, batch, none")
    r = jnp.asarray(rewards, jnp.float32)
    G = num_generations
    if r.ndim != 1 or r.shape[0] % G:
        raise ValueError(f"rewards must be [P * {G}] (groups of num_generations adjacent); got {r.shape}")
    grouped = r.reshape(-1, G)  # [P, G]
    mean = jnp.repeat(_nanmean(grouped, axis=1), G)  # [P*G]
    advantages = r - mean
    if scale_rewards == "group":
        std = jnp.repeat(_nanstd(grouped, axis=1), G) if G > 1 else jnp.zeros_like(r)
        advantages = advantages / (std + STD_EPS)
    elif scale_rewards == "batch":
        std = _nanstd(r) if r.shape[0] > 1 else jnp.zeros(())
        advantages = advantages / (std + STD_EPS)
    return jnp.where(jnp.isnan(advantages), 0.0, advantages)


# ---- the token loss ---------------------------------------------------------------------------------------------

def policy_loss_sums(logps: jax.Array, old_logps: jax.Array | None, ref_logps: jax.Array | None,
                     advantages: jax.Array, mask: jax.Array, settings: GRPOLossSettings) -> tuple[jax.Array, dict]:
    """The loss as (loss_sum, sums) in the step's sum convention (module docstring): logps / old_logps /
    ref_logps / mask [R, T], advantages [R] (or [R, 1]). `old_logps` None: on-policy (TRL's num_iterations == 1
    shortcut, old = stop_gradient(logps)); `ref_logps` is read only when beta > 0.

    sums (fp32 scalars, to be summed over micro-batches): "tokens" (the count loss_sum is a sum over),
    "completion_tokens", "sequences", "kl" (sum of the masked per-token KL; 0 when beta == 0), "clip_ratio/
    low_mean" / "high_mean" / "region_mean" (clipped tokens, or completions for gspo) and "clip_count" (their
    denominator). `mean_metrics` turns summed sums into TRL's logged means."""
    m = mask.astype(jnp.float32)
    on = m > 0
    # masked positions are zeroed first: no exp() of an arbitrary difference there (no inf * 0 in the gradient)
    lp = jnp.where(on, logps.astype(jnp.float32), 0.0)  # [R, T]
    old = jax.lax.stop_gradient(lp) if old_logps is None else jnp.where(on, old_logps.astype(jnp.float32), 0.0)
    R = lp.shape[0]
    adv = advantages.astype(jnp.float32).reshape(R, 1)  # [R] or [R, 1] -> [R, 1]
    row_tokens = jnp.sum(m, axis=-1)  # [R]
    log_ratio = lp - old
    if settings.loss_type == "gspo":  # one importance ratio per completion: exp(mean_t log-ratio)
        log_ratio = (jnp.sum(log_ratio * m, axis=-1) / jnp.maximum(row_tokens, 1.0))[:, None]  # [R, 1]
    ratio = jnp.exp(log_ratio)  # [R, T] (gspo: [R, 1])
    lo, hi = 1.0 - settings.epsilon, 1.0 + settings.clip_high
    clipped = jnp.clip(ratio, lo, hi)
    token_loss = -jnp.minimum(ratio * adv, clipped * adv)  # [R, T] (gspo: [R, 1], broadcast over the tokens)

    kl_sum = jnp.zeros((), jnp.float32)
    if settings.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probabilities (ref_logps)")
        d = jnp.where(on, ref_logps.astype(jnp.float32), 0.0) - lp
        kl = jnp.exp(d) - d - 1.0  # [R, T] k3 estimator of KL(policy || reference)
        token_loss = token_loss + settings.beta * kl
        kl_sum = jnp.sum(kl * m)

    masked = jnp.broadcast_to(token_loss, m.shape) * m  # [R, T]
    if settings.loss_type in ("grpo", "gspo"):
        loss_sum, count = jnp.sum(jnp.sum(masked, axis=-1) / jnp.maximum(row_tokens, 1.0)), jnp.float32(R)
    elif settings.loss_type == "dr_grpo":
        loss_sum, count = jnp.sum(masked) / settings.max_completion_length, jnp.float32(R)
    else:  # dapo
        loss_sum, count = jnp.sum(masked), jnp.sum(m)

    # TRL's clip metrics: the ratio outside the band on the side where clipping stops the gradient
    low = ((ratio < lo) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > hi) & (adv > 0)).astype(jnp.float32)
    region = jnp.maximum(low, high)
    if settings.loss_type == "gspo":  # per completion
        clip_sums = [jnp.sum(x) for x in (low, high, region)]
        clip_count = jnp.float32(R)
    else:  # per completion token
        clip_sums = [jnp.sum(x * m) for x in (low, high, region)]
        clip_count = jnp.sum(m)
    sums = {"tokens": count, "completion_tokens": jnp.sum(m), "sequences": jnp.float32(R), "kl": kl_sum,
            "clip_ratio/low_mean": clip_sums[0], "clip_ratio/high_mean": clip_sums[1],
            "clip_ratio/region_mean": clip_sums[2], "clip_count": clip_count}
    return loss_sum, jax.tree.map(lambda x: jax.lax.stop_gradient(jnp.asarray(x, jnp.float32)), sums)


def mean_metrics(sums: dict) -> dict:
    """Summed sums (one micro-batch's, or a step's summed over micro-batches) -> TRL's logged means:
    "kl" (per completion token) and "clip_ratio/low_mean", "high_mean", "region_mean"."""
    return {k: sums[k] / jnp.maximum(sums[d], 1.0) for k, d in METRIC_DENOMINATORS.items()}


def grpo_token_loss(logps: jax.Array, old_logps: jax.Array | None, ref_logps: jax.Array | None,
                    advantages: jax.Array, mask: jax.Array, *, loss_type: LossType, epsilon: float,
                    epsilon_high: float | None, beta: float, max_completion_length: int) -> tuple[jax.Array, dict]:
    """TRL's GRPO loss of one batch (no accumulation): logps / old_logps / ref_logps / mask [R, T] (fp32
    per-token log-probabilities of the completion tokens; mask 1 on them), advantages [R] -> (loss scalar,
    {"kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}) (module docstring)."""
    settings = GRPOLossSettings(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                                max_completion_length=max_completion_length)
    loss_sum, sums = policy_loss_sums(logps, old_logps, ref_logps, advantages, mask, settings)
    return loss_sum / jnp.maximum(sums["tokens"], 1.0), mean_metrics(sums)


# ---- the model-level loss --------------------------------------------------------------------------------------

def grpo_loss(model, batch: dict, *, chunk: int = DEFAULT_CHUNK_TOKENS, settings: GRPOLossSettings,
              router: RouterLossWeights | None = None) -> tuple[jax.Array, dict]:
    """The GRPO loss of a `Decoder` on a micro-batch of rollouts, in the step's sum convention (module docstring).

    batch (one completion per row, prompt + completion, right-padded):
        tokens, positions, segment_ids, targets [R, T]   (targets: the next token at each position)
        completion_mask [R, T]   1 where the target is a completion token (0 on prompt, padding, masked truncations)
        advantages [R] or [R, 1] group_advantages of the rollouts' rewards ([R, 1]: the trainer's [A, B, ...]
                                 batch sharding splits rows and a second axis, so a per-row key needs one)
        old_logps [R, T]         the rollout policy's log-probs of the targets (optional: absent = on-policy)
        ref_logps [R, T]         the reference model's (read only when settings.beta > 0)
    Returns (loss_sum, aux): aux["tokens"] is the count loss_sum is a sum over; the other aux entries are the
    sums of `policy_loss_sums` (`mean_metrics` of the step's summed metrics gives kl and the clip ratios).

    `router` (a MoE model): the router losses join the sum weighted by the count, as in surojax.losses.lm.lm_loss,
    and aux["router"] holds the layers' RouterStats.
    """
    if router is not None and model.cfg.moe is None:
        raise ValueError("router losses need a mixture-of-experts model; this one is dense")
    h, _, stats = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"])
    stats = None if router is None else collected(stats)
    logps = target_logps(h, model.head_weight(), batch["targets"], temperature=settings.temperature, chunk=chunk,
                         softcap=model.cfg.final_logit_softcapping)
    loss_sum, aux = policy_loss_sums(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                                     batch["completion_mask"], settings)
    if stats is not None:
        loss_sum = loss_sum + router_loss(stats, router) * aux["tokens"]
        aux["router"] = jax.lax.stop_gradient(stats)
    return loss_sum, aux
