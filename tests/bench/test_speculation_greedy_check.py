"""benchmarks/speculation.py's greedy check: the first divergence's margin in a reference forward's logits, the
near-tie verdict (bf16 only; float32 must be exact), the break-even acceptance, and the early-exit draft built from
the target's layers."""
import argparse

import numpy as np
from flax import nnx

from benchmarks.speculation import break_even, build_models, first_divergence, greedy_check, verdict


def test_first_divergence_margin_and_verdict():
    row = np.zeros(8, np.float32)
    row[[2, 5, 6]] = [1.0, 0.99, 3.0]  # sd ~1.0
    seen = []

    def logits_fn(ids):
        seen.append(list(ids))
        return np.stack([np.zeros(8, np.float32)] * (len(ids) - 1) + [row])

    assert first_divergence(logits_fn, [7, 7], [1, 2, 3], [1, 2, 3]) is None
    d = first_divergence(logits_fn, [7, 7], [1, 2, 3], [1, 5, 0])
    assert seen == [[7, 7, 1]]  # the prompt and the common prefix: the context of the first differing token
    assert d["at"] == 1 and np.isclose(d["margin"], 0.01) and np.isclose(d["top2"], 2.0)
    near = greedy_check([None, d], "bfloat16", near_tie=0.05)
    assert near["greedy_ok"] and not near["greedy_equal"] and near["diverged"] == 1
    assert verdict(dict(near, requests=2)).startswith("near-ties: 1/2 differ")
    assert not greedy_check([None, d], "float32", near_tie=0.05)["greedy_ok"]  # float32: exact or a failure
    far = first_divergence(logits_fn, [7], [6], [2])  # 3.0 - 1.0: no near-tie
    assert not greedy_check([far], "bfloat16", near_tie=0.05)["greedy_ok"]
    assert greedy_check([None, None], "float32", near_tie=0.05) == dict(greedy_equal=True, diverged=0,
                                                                          greedy_ok=True)


def test_break_even():
    """A draft step at 0.5x the baseline's tok/s emitting one token: it needs one accepted proposal per step more."""
    assert break_even(dict(speedup=0.5, accepted_per_step=0.0)) == 1.0
    assert break_even(dict(speedup=2.0, accepted_per_step=3.0)) == 1.0
    assert break_even(dict(speedup=None, accepted_per_step=None)) is None


def test_draft_is_the_targets_first_layers():
    """Every draft weight is the target's (its layer stack the first --draft-layers of the target's), after both
    took the serving layout; the draft is a model of its own config (one layer here)."""
    a = argparse.Namespace(shape="debug", untie=True, dtype="float32", draft="first-layers", draft_layers=1,
                           smoke=True)
    target, draft = build_models(a, with_draft=True)
    assert (draft.cfg.num_layers, target.cfg.num_layers) == (1, 2)
    t = dict(nnx.to_flat_state(nnx.state(target, nnx.Param)))
    d = dict(nnx.to_flat_state(nnx.state(draft, nnx.Param)))
    assert t.keys() == d.keys() and any(p[0] == "layers" for p in d)
    for path, var in d.items():
        want = t[path].get_value()
        np.testing.assert_array_equal(var.get_value(), want[:1] if path[0] == "layers" else want, err_msg=str(path))


def test_reference_logits_pad_past_the_sequence():
    """The margin's forward: the sequence padded to a fixed length gives the unpadded forward's logits (causal)."""
    import jax.numpy as jnp

    from benchmarks.speculation import reference_logits

    a = argparse.Namespace(shape="debug", untie=True, dtype="float32", draft="random", draft_layers=1, smoke=True)
    target, _ = build_models(a, with_draft=False)
    ids = [5, 9, 11, 300, 2]
    np.testing.assert_allclose(reference_logits(target, 16)(ids), target(jnp.asarray([ids]))[0], atol=1e-4)


def test_smoke_run_is_exact_in_float32():
    """The CPU smoke run (float32, an untied target: outputs that do not just repeat) exits 0: equal, token for token."""
    from benchmarks.speculation import main

    assert main(["--smoke", "--shapes", "qwen3-0.6b", "--untie", "--users", "2", "--workloads", "chat",
                 "--methods", "off,ngram"]) == 0
