"""The GRPO loss against the published formulas (NumPy, written here) and TRL's own numbers.

TRL's numbers (tests/fixtures/grpo/trl_loss.json, made by scripts/make_grpo_golden.py with trl's
GRPOTrainer._compute_loss in the reference env) give the loss, its gradient with respect to the per-token
log-probabilities and the logged kl / clip ratios for each loss_type, with and without the KL term.
"""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.losses.grpo import (GRPOLossSettings, group_advantages, grpo_loss, grpo_token_loss, mean_metrics,
                                 policy_loss_sums, target_logps)
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "grpo" / "trl_loss.json").read_text())
EPS, EPS_HIGH, L = GOLDEN["epsilon"], GOLDEN["epsilon_high"], GOLDEN["max_completion_length"]
INPUTS = {k: np.asarray(v) for k, v in GOLDEN["inputs"].items()}


def numpy_grpo(logps, old, ref, adv, mask, *, loss_type, beta, eps=EPS, eps_high=EPS_HIGH, max_len=L):
    """The objectives as published: GRPO (DeepSeekMath eq. 3, k3 KL), Dr. GRPO (constant normaliser), DAPO
    (token-level sum over the batch's tokens, clip-higher), GSPO (length-normalised sequence ratio)."""
    R = logps.shape[0]
    n_i = mask.sum(1)
    if loss_type == "gspo":
        s = np.exp(((logps - old) * mask).sum(1) / np.maximum(n_i, 1))  # [R] (pi / pi_old)^(1/|y|)
        ratio = np.repeat(s[:, None], logps.shape[1], axis=1)
    else:
        ratio = np.exp(logps - old)
    surrogate = np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps_high) * adv[:, None])
    kl = np.exp(ref - logps) - (ref - logps) - 1
    per_token = -(surrogate - beta * kl) * mask
    if loss_type in ("grpo", "gspo"):
        loss = np.mean(per_token.sum(1) / np.maximum(n_i, 1))
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (R * max_len)
    else:
        loss = per_token.sum() / mask.sum()
    return loss, (kl * mask).sum() / mask.sum()


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"{c['loss_type']}-beta{c['beta']}")
def test_token_loss_matches_formula_and_trl(case):
    x = INPUTS
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
    kwargs = dict(loss_type=case["loss_type"], epsilon=EPS, epsilon_high=EPS_HIGH, beta=case["beta"],
                  max_completion_length=L)

    def loss_of(logps):
        return grpo_token_loss(logps, f32["old_logps"], f32["ref_logps"], f32["advantages"], f32["mask"], **kwargs)

    (loss, metrics), grad = jax.value_and_grad(loss_of, has_aux=True)(f32["logps"])
    want, want_kl = numpy_grpo(x["logps"], x["old_logps"], x["ref_logps"], x["advantages"], x["mask"],
                               loss_type=case["loss_type"], beta=case["beta"])
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(loss), case["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(case["grad_logps"]), rtol=1e-4, atol=1e-7)
    for key, value in case["metrics"].items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-6, err_msg=key)
    if case["beta"]:
        np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-5)
    assert case["metrics"]["clip_ratio/low_mean"] > 0 and case["metrics"]["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages(scale):
    rewards = np.array([1.0, 0.0, 1.0, 0.5,  # an ordinary group
                        2.0, 2.0, 2.0, 2.0,  # no spread: advantage 0
                        3.0, np.nan, 1.0, 2.0,  # one unscorable completion: out of the baseline, advantage 0
                        np.nan, np.nan, 5.0, np.nan])  # one scorable: group std undefined
    G = 4
    grouped = rewards.reshape(-1, G)
    with np.errstate(invalid="ignore"), pytest.warns(RuntimeWarning):
        mean = np.repeat(np.nanmean(grouped, axis=1), G)
        std = {"group": np.repeat(np.nanstd(grouped, axis=1, ddof=1), G), "batch": np.nanstd(rewards, ddof=1),
               "none": 0.0}[scale]
    want = (rewards - mean) / ((std + 1e-4) if scale != "none" else 1.0)
    want = np.nan_to_num(want, nan=0.0)
    got = np.asarray(group_advantages(jnp.asarray(rewards), G, scale))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(got[4:8] == 0) and got[9] == 0 and np.abs(got[:4]).min() > 0.05


def test_accumulation_composes_to_the_step_loss():
    """Micro-batch (loss_sum, count) pairs summed then divided (train/step.py) equal TRL's per-step loss on the
    whole batch, for every loss type: two micro-batches of 3 completions."""
    x = {k: jnp.asarray(v, jnp.float32) for k, v in INPUTS.items()}
    for loss_type in ("grpo", "dr_grpo", "dapo", "gspo"):
        s = GRPOLossSettings(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=0.04,
                             max_completion_length=L)
        halves = [policy_loss_sums(*(x[k][sl] for k in ("logps", "old_logps", "ref_logps", "advantages", "mask")),
                                   s) for sl in (slice(0, 3), slice(3, 6))]
        total = sum(h[0] for h in halves) / sum(h[1]["tokens"] for h in halves)
        whole, _ = numpy_grpo(*(INPUTS[k] for k in ("logps", "old_logps", "ref_logps", "advantages", "mask")),
                              loss_type=loss_type, beta=0.04)
        np.testing.assert_allclose(float(total), whole, rtol=1e-5, err_msg=loss_type)
        summed = jax.tree.map(lambda a, b: a + b, halves[0][1], halves[1][1])
        whole_metrics = grpo_token_loss(x["logps"], x["old_logps"], x["ref_logps"], x["advantages"], x["mask"],
                                        loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=0.04,
                                        max_completion_length=L)[1]
        for k, v in mean_metrics(summed).items():
            np.testing.assert_allclose(float(v), float(whole_metrics[k]), rtol=1e-6, err_msg=k)


def test_on_policy_old_logps_default_to_the_detached_policy():
    """old_logps None (num_iterations 1): ratio 1, loss -mean(A) shaped per loss type, gradient -A per token / norm."""
    x = {k: jnp.asarray(v, jnp.float32) for k, v in INPUTS.items()}
    s = GRPOLossSettings(loss_type="dapo")
    g = jax.grad(lambda lp: policy_loss_sums(lp, None, None, x["advantages"], x["mask"], s)[0])(x["logps"])
    np.testing.assert_allclose(np.asarray(g), -INPUTS["advantages"][:, None] * INPUTS["mask"], rtol=1e-6)
    column = policy_loss_sums(x["logps"], None, None, x["advantages"][:, None], x["mask"], s)[0]  # [R, 1] too
    np.testing.assert_allclose(float(column), -float((x["advantages"][:, None] * x["mask"]).sum()), rtol=1e-6)


TINY = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}


def test_chunked_logps_value_and_gradient():
    """target_logps (chunks of 5 over 21 tokens: a padded last chunk) equals log_softmax(logits / temperature) at
    the targets, value and gradients, for an arbitrary upstream cotangent."""
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.normal(size=(3, 7, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 50)) / 4, jnp.float32)
    t = jnp.asarray(rng.integers(0, 50, (3, 7)), jnp.int32)
    cot = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)

    def plain(h, w):
        logits = jnp.einsum("btd,dv->btv", h, w) / 0.7
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), t[..., None], -1)[..., 0]

    def value_and_grad(f):  # one compiled program per side (value and gradients), not op by op
        return jax.jit(lambda h, w: (f(h, w), jax.grad(lambda h, w: jnp.sum(f(h, w) * cot), (0, 1))(h, w)))(h, w)

    got, g_got = value_and_grad(lambda h, w: target_logps(h, w, t, temperature=0.7, chunk=5))
    want, g_want = value_and_grad(plain)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


TINY = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}


def test_model_loss_is_the_token_loss_of_the_model_logps():
    """grpo_loss on a tiny decoder equals the token loss on log_softmax(model logits / temperature) at the targets,
    in the step's sum convention (grpo: the sum of row means over the rows)."""
    model = Decoder(ModelConfig.from_hf(TINY), attention="xla", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    R, T = 4, 9
    tokens = jnp.asarray(rng.integers(0, 64, (R, T)), jnp.int32)
    mask = jnp.asarray((np.arange(T)[None] >= 3) & (np.arange(T)[None] < np.array([[9], [7], [5], [4]])), jnp.int32)
    batch = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T)),
             "segment_ids": jnp.ones((R, T), jnp.int32), "targets": jnp.roll(tokens, -1, axis=1),
             "completion_mask": mask, "advantages": jnp.asarray([1.0, -0.5, 0.3, -0.8], jnp.float32),
             "old_logps": jnp.asarray(rng.normal(-4.2, 0.3, (R, T)), jnp.float32),
             "ref_logps": jnp.asarray(rng.normal(-4.2, 0.3, (R, T)), jnp.float32)}
    s = GRPOLossSettings(loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=0.1, temperature=0.7)

    loss_sum, aux = nnx.jit(lambda m, b: grpo_loss(m, b, chunk=5, settings=s))(model, batch)  # one compile
    logits = nnx.jit(lambda m, b: m(b["tokens"], b["positions"], b["segment_ids"]))(model, batch)
    logits = logits.astype(jnp.float32) / 0.7
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["targets"][..., None], -1)[..., 0]
    want, metrics = grpo_token_loss(lp, batch["old_logps"], batch["ref_logps"], batch["advantages"], mask,
                                    loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=0.1,
                                    max_completion_length=256)
    assert float(aux["tokens"]) == R and float(aux["completion_tokens"]) == float(mask.sum())
    np.testing.assert_allclose(float(loss_sum / aux["tokens"]), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(mean_metrics(aux)["kl"]), float(metrics["kl"]), rtol=1e-5)
