"""Surogate's adaptive training rules on synthetic (numpy-generated) loss streams: the loss guard's cuts and their
blend-back, the phases, the four early-stop rules, the Chinchilla epochs and the checkpoint round trip."""
import json
import math
from fractions import Fraction

import numpy as np
import pytest

from surojax.config.optim import OptimSection
from surojax.train.adaptive import (AdaptiveSettings, AdaptiveTraining, budget_line, Decision, epochs_for_budget,
                                    flops_per_token)
from surojax.train.early_stop import convergence_score, EarlyStopRules

FLOPS = flops_per_token(1_000_000)
GUARD = AdaptiveSettings(auto_lr_reduction=True)
STOP = AdaptiveSettings(early_stop=True)
ALL = AdaptiveSettings(auto_lr_reduction=True, early_stop=True, epoch_adjustment=True)


def run(settings, losses, gnorms=None, tokens=1000, evals=None) -> list[Decision]:
    """Feed step i the loss losses[i], grad norm gnorms[i] (default 1.0), tokens[i] (or a constant); after the
    steps listed in `evals` ({step: eval_loss}) also an eval. Returns the step decisions."""
    adaptive = AdaptiveTraining(settings, flops_per_token=FLOPS)
    return feed(adaptive, losses, gnorms, tokens, evals)


def feed(adaptive, losses, gnorms=None, tokens=1000, evals=None, start=0) -> list[Decision]:
    n = len(losses)
    gnorms = np.ones(n) if gnorms is None else gnorms
    tokens = np.full(n, tokens) if np.isscalar(tokens) else tokens
    out = []
    for i in range(start, n):
        out.append(adaptive.observe(i, float(losses[i]), float(gnorms[i]), int(tokens[i])))
        if evals and i in evals:
            out.append(adaptive.observe_eval(i, evals[i]))
    return out


def flat(n, level=2.0, noise=0.01, seed=0):
    return level + noise * np.random.default_rng(seed).standard_normal(n)


def scales(decisions):
    return np.array([d.lr_scale for d in decisions])


def test_every_switch_off_changes_nothing():
    losses = np.concatenate([flat(700), 2.0 + 0.01 * np.arange(300)])
    losses[[100, 300]] = [50.0, np.nan]
    gnorms = np.ones(1000)
    gnorms[[200, 400]] = [1e4, np.inf]
    ds = run(AdaptiveSettings(), losses, gnorms, evals={k: 2.0 for k in range(0, 1000, 10)})
    assert all(d.lr_scale == 1.0 and not d.skip_update and d.stop is None and d.events == () for d in ds)
    assert ds[-1].phase == "diverging"  # the phase is still reported


def test_spike_cuts_temporarily_and_blends_back_linearly_over_50_steps():
    losses = flat(200)
    losses[100] = 4.0
    ds = run(GUARD, losses)
    assert "loss spike" in ds[100].events[0] and "for 50 steps" in ds[100].events[0]
    assert scales(ds[:100]).tolist() == [1.0] * 100
    # the decision at step 100 is the scale of step 101: x 0.5, then linearly back to 1 at step 151
    np.testing.assert_allclose(scales(ds[100:151]), np.linspace(0.5, 1.0, 51), rtol=0, atol=1e-12)
    assert scales(ds[151:]).tolist() == [1.0] * 49
    assert not any(d.skip_update for d in ds)


@pytest.mark.parametrize("noise, jump, fires", [(0.01, 0.4, False), (0.01, 0.6, True),
                                                (0.3, 0.6, False), (0.3, 1.5, True)])
def test_spike_needs_three_sigma_and_half_a_unit(noise, jump, fires):
    losses = flat(101, noise=noise)
    losses[100] = 2.0 + jump
    assert (ds := run(GUARD, losses))[100].lr_scale == (0.5 if fires else 1.0)
    assert bool(ds[100].events) == fires


@pytest.mark.parametrize("mean_gnorm, gnorm, fires", [(1.0, 150.0, True), (1.0, 12.0, True), (1.0, 9.0, False),
                                                      (20.0, 150.0, True), (20.0, 99.0, False)])
def test_grad_norm_over_ten_times_its_mean_or_over_100_cuts(mean_gnorm, gnorm, fires):
    gnorms = mean_gnorm * (1 + 0.05 * np.random.default_rng(1).standard_normal(101))
    gnorms[100] = gnorm
    ds = run(GUARD, flat(101), gnorms)
    assert ds[100].lr_scale == (0.5 if fires else 1.0)
    assert ("grad norm" in ds[100].events[0]) if fires else ds[100].events == ()


def test_nan_skips_the_update_and_cuts_even_in_warmup():
    losses, gnorms = flat(100), np.ones(100)
    losses[5], losses[20], gnorms[80] = np.nan, np.inf, np.inf
    ds = run(GUARD, losses, gnorms)
    assert [i for i, d in enumerate(ds) if d.skip_update] == [5, 20, 80]
    assert ds[5].lr_scale == 0.5 and "non-finite" in ds[5].events[0]
    # step 20 is inside the 50-step cool-down: skipped, not cut; the blend goes on
    assert "no new cut" in ds[20].events[0] and ds[20].lr_scale == pytest.approx(0.5 + 0.5 * 15 / 50)
    assert ds[79].lr_scale == 1.0 and ds[80].lr_scale == 0.5 and "permanent cut 1/5" in ds[80].events[0]


def test_an_anomaly_within_the_cooldown_does_not_cut():
    losses, gnorms = flat(200), np.ones(200)
    losses[100], gnorms[120], gnorms[170] = 4.0, 1000.0, 1000.0
    ds = run(GUARD, losses, gnorms)
    assert "no new cut" in ds[120].events[0] and ds[120].lr_scale == pytest.approx(0.5 + 0.5 * 20 / 50)
    assert "permanent cut 1/5" in ds[170].events[0] and ds[170].lr_scale == 0.5


def test_first_anomaly_is_temporary_then_at_most_five_permanent_cuts():
    """Anomalies 60 steps apart: the 1st is temporary, the 2nd ... 6th halve the scale for good, the 7th (the
    6th after the temporary one) cuts no further."""
    anomalies = [100 + 60 * k for k in range(7)]
    gnorms = np.ones(560)
    gnorms[anomalies] = 1000.0
    ds = run(GUARD, flat(560), gnorms)
    settled = [ds[a + 59].lr_scale for a in anomalies]  # the scale once any blend is over
    assert settled == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]
    assert "no further cut" in ds[anomalies[-1]].events[0]


def test_a_steadily_decreasing_noisy_curve_is_converging_and_does_not_stop():
    t = np.arange(2000)
    losses = 4.0 - 0.001 * t + 0.01 * np.random.default_rng(2).standard_normal(2000)
    ds = run(ALL, losses, tokens=4096)
    assert [d.phase for d in ds[:50]] == ["warmup"] * 50
    assert {d.phase for d in ds[50:]} == {"converging"}
    assert all(d.stop is None and d.lr_scale == 1.0 for d in ds)


def test_a_fast_falling_curve_is_converging_not_unstable():
    """Over the 100-step window the CV is ~19 % (slope); over its recent half, the one the rule reads, ~11 %."""
    ds = run(STOP, 5.0 - 0.02 * np.arange(150))
    assert {d.phase for d in ds[50:]} == {"converging"}


def test_a_flat_curve_stops_for_plateau_after_500_plateau_steps():
    ds = run(STOP, flat(700, noise=0.002))
    assert [d.phase for d in ds[:50]] == ["warmup"] * 50
    assert {d.phase for d in ds[50:549]} == {"plateau"}
    assert [d.stop for d in ds[:549]] == [None] * 549  # 499 plateau steps: not yet
    assert ds[549].stop == "plateau" and "plateau for 500 steps" in ds[549].events[-1]
    assert all(d.stop == "plateau" for d in ds[549:])


def test_a_rising_curve_stops_for_divergence_after_200_steps():
    losses = 2.0 + 0.002 * np.arange(400) + 0.002 * np.random.default_rng(3).standard_normal(400)
    ds = run(STOP, losses)
    assert {d.phase for d in ds[50:250]} == {"diverging"}
    assert [d.stop for d in ds[:249]] == [None] * 249
    assert ds[249].stop == "diverging"


def test_a_noisy_curve_is_unstable_and_never_stops():
    losses = 2.0 * np.exp(0.3 * np.random.default_rng(4).standard_normal(800))  # CV ~ 30 %
    ds = run(STOP, losses)
    assert {d.phase for d in ds[50:]} == {"unstable"}
    assert all(d.stop is None for d in ds)


@pytest.mark.parametrize("evals, expected", [([2.0, 2.0], 1.0),
                                             ([2.0, 1.9], 0.6 * (1 - 0.05 / 1.95) + 0.4 * 0.0),
                                             ([2.0, 1.98], 0.6 * (1 - 0.01 / 1.99) + 0.4 * 0.8),
                                             ([1.9, 2.0], 0.6 * (1 - 0.05 / 1.95) + 0.4 * 1.0)])
def test_convergence_score_by_hand(evals, expected):
    assert convergence_score(evals, EarlyStopRules()) == pytest.approx(expected, rel=1e-12)


def reference_score(evals):
    """0.6 (1 - CV of the last 5) + 0.4 clip(1 - 20 r), written independently of the module."""
    w = np.array(evals[-5:])
    r = (evals[-2] - evals[-1]) / evals[-2]
    return 0.6 * np.clip(1 - w.std() / w.mean(), 0, 1) + 0.4 * np.clip(1 - 20 * r, 0, 1)


def test_eval_convergence_stops_after_five_evals_above_085():
    evals = [3.0, 2.6, 2.3, 2.1, 2.0, 1.97, 1.95, 1.94, 1.935, 1.93, 1.93, 1.93, 1.93, 1.93]
    above = [i >= 1 and reference_score(evals[:i + 1]) > 0.85 for i in range(len(evals))]
    first_stop = next(i for i in range(4, len(evals)) if all(above[i - 4:i + 1]))
    assert first_stop >= 8  # the stream starts far from converged
    adaptive = AdaptiveTraining(STOP, flops_per_token=FLOPS)
    stops = [adaptive.observe_eval(100 * i, e).stop for i, e in enumerate(evals)]
    assert stops == [None] * first_stop + ["convergence"] * (len(evals) - first_stop)


def test_eval_loss_improving_five_percent_per_eval_never_converges():
    adaptive = AdaptiveTraining(STOP, flops_per_token=FLOPS)
    assert all(adaptive.observe_eval(i, 3.0 * 0.95 ** i).stop is None for i in range(30))


@pytest.mark.parametrize("slope_after, tokens_after, stop_at", [(0.0005, 1000, 699), (0.002, 4000, 649),
                                                                (0.008, 4000, None)])
def test_loss_reduction_per_flop_under_half_its_peak_stops(slope_after, tokens_after, stop_at):
    """Slope 0.002 per step at 1000 tokens per step, then from step 600 `slope_after` at `tokens_after`: the rate
    per FLOP is measured every 50 steps: the drop of the mean loss from the older to the recent half of the
    100-step window, over the FLOPs of the recent half. Slope / 4: the rate is 0.63 x peak at step 649 (half of the
    window after the change), 0.25 x at 699. Same slope, 4x tokens: 0.25 x already at 649 (the recent half cost 4x
    the FLOPs). Slope and tokens both 4x: the rate per FLOP is unchanged, no stop."""
    t = np.arange(1000)
    losses = np.where(t < 600, 10.0 - 0.002 * t, 10.0 - 1.2 - slope_after * (t - 600))
    losses = losses + 0.002 * np.random.default_rng(5).standard_normal(1000)
    ds = run(STOP, losses, tokens=np.where(t < 600, 1000, tokens_after))
    assert {d.phase for d in ds[50:]} == {"converging"}  # not a plateau: the FLOP rule is the one that fires
    stops = [i for i, d in enumerate(ds) if d.stop is not None]
    assert (stops[0] if stops else None) == stop_at
    if stop_at is not None:
        assert ds[stop_at].stop == "flop_efficiency"


def test_a_power_law_curve_stops_on_the_flop_rule_soon_after_its_peak():
    """The rule as written, checked against an independent evaluation of it on the noise-free curve: the rate of
    each 50-step measurement, the running peak, the first measurement under half of it."""
    t = np.arange(1000)
    losses = 1.5 + 2.0 * (1 + t / 50) ** -0.5
    ends = np.arange(99, 1000, 50)
    rates = [(losses[m - 99:m - 49].mean() - losses[m - 49:m + 1].mean()) / (FLOPS * 50 * 1000) for m in ends]
    peaks = np.maximum.accumulate(rates)
    expected = next(m for m, r, p in zip(ends[1:], rates[1:], peaks[:-1]) if r < 0.5 * p)
    ds = run(STOP, losses)
    assert [d.stop for d in ds[:expected]] == [None] * expected
    assert ds[expected].stop == "flop_efficiency" and expected < 300


@pytest.mark.parametrize("num_params, dataset_tokens", [(1_000_000, 20_000_000), (1_000_000, 19_999_999),
                                                        (1_000_000, 3_000_000), (123_456_789, 987_654_321),
                                                        (1_000, 10**9), (8 * 10**9, 10**7)])
def test_epochs_for_budget(num_params, dataset_tokens):
    exact = math.ceil(Fraction(20 * num_params, dataset_tokens))
    assert epochs_for_budget(num_params, dataset_tokens) == min(max(exact, 1), 50)


def test_epochs_for_budget_values():
    assert [epochs_for_budget(10**6, d) for d in (2 * 10**7, 2 * 10**7 - 1, 3 * 10**6, 10**9)] == [1, 2, 7, 1]
    assert epochs_for_budget(8 * 10**9, 10**7) == 50


def test_state_round_trip_through_json_resumes_identically():
    rng = np.random.default_rng(6)
    losses = 3.0 - 0.002 * np.arange(300) + 0.01 * rng.standard_normal(300)
    gnorms = 1.0 + 0.05 * rng.standard_normal(300)
    losses[[120, 260]], gnorms[[140, 200]] = [6.0, 8.0], [np.nan, 500.0]
    evals = {k: 2.5 - 0.001 * k for k in range(49, 300, 50)}
    uninterrupted = run(ALL, losses, gnorms, evals=evals)

    first = AdaptiveTraining(ALL, flops_per_token=FLOPS)
    head = feed(first, losses[:150], gnorms[:150], evals=evals)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = AdaptiveTraining(ALL, flops_per_token=FLOPS)
    resumed.load_state_dict(state)
    tail = feed(resumed, losses, gnorms, evals=evals, start=150)
    assert head + tail == uninterrupted
    # the test can fail: a fresh object (no state) decides differently from step 150 on
    assert feed(AdaptiveTraining(ALL, flops_per_token=FLOPS), losses, gnorms, evals=evals, start=150) != tail
    assert tail[0].lr_scale < 1.0 and any(d.events for d in tail)  # mid-blend at the save, events after it


def test_settings_from_the_config_keys():
    optim = OptimSection(auto_lr_reduction=True, early_stop=False, epoch_adjustment=True)
    assert AdaptiveSettings.from_optim(optim) == AdaptiveSettings(auto_lr_reduction=True, epoch_adjustment=True)
    with pytest.raises(ValueError, match="flops_per_token"):
        AdaptiveTraining(STOP, flops_per_token=0.0)


def test_budget_line_says_when_the_epochs_are_capped():
    assert budget_line(10**6, 3 * 10**6).endswith("-> 7 epochs")
    assert budget_line(8 * 10**9, 10**7).endswith("-> 50 epochs (capped at 50)")
