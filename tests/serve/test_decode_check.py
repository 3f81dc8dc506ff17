"""The teacher-forced decode check (``serve/decode_check.py``): every real decode path PASSES against the fp32
reference (fp32 on CPU: the Pallas kernel in interpret mode), and a wrong attention in the Pallas path
(an off-by-one length: the new token not attended; an output off by 1%) FAILS."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import surojax.models.layers.attention as attention
from surojax.serve.decode_check import format_check, teacher_forced_check
from surojax.serve.forced_decode import forced_decode
from surojax.weights.hf_checkpoint import load_model

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"
BS, R, K, NB, NUM_BLOCKS = 4, 3, 3, 10, 40


@pytest.fixture(scope="module")
def setup():
    model = load_model(FIXTURE, attention="xla")
    graphdef, state = nnx.split(model)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, NUM_BLOCKS * BS, cfg.num_kv_heads, cfg.head_dim)
    pools = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)]
    table = rng.permutation(NUM_BLOCKS)[: R * NB].reshape(R, NB).astype(np.int32)
    start = np.array([7, 0, 30], np.int32)  # row 1: an empty context
    tokens = rng.integers(1, cfg.vocab_size, (R, K)).astype(np.int32)
    return graphdef, state, *pools, tokens, start, table


def test_real_paths_pass(setup):
    results = {r["check"]: r for r in teacher_forced_check(*setup, block_size=BS)}
    assert set(results) == {"reference", "gather", "reduce", "pallas"}
    for name in ("gather", "reduce", "pallas"):
        r = results[name]
        assert r["pass"], format_check(r)
        assert not r["stray_writes"] and r["kv_layer0_max_abs_diff"] == 0.0
        assert r["decisive"] > 0 and r["argmax_disagree"] == 0
    # fp32: the reference is the truth and the gather path is the reference, bit for bit
    assert results["reference"]["logits_rel_err"] == 0.0
    assert results["gather"]["logits_rel_err"] == 0.0 and results["gather"]["kv_rel_err"] == 0.0
    assert 0 < results["pallas"]["logits_rel_err"] < 1e-5


def _off_by_one(real):
    return lambda q, k, v, layer, table, lengths, **kw: real(q, k, v, layer, table, jnp.maximum(lengths - 1, 0), **kw)


def _one_percent(real):
    return lambda *a, **kw: real(*a, **kw) * 1.01


@pytest.mark.parametrize("wrong", [_off_by_one, _one_percent])
def test_a_wrong_kernel_fails(setup, monkeypatch, wrong):
    monkeypatch.setattr(attention, "paged_decode_attention", wrong(attention.paged_decode_attention))
    forced_decode.clear_cache()  # trace again with the wrong kernel
    try:
        ref, pallas = teacher_forced_check(*setup, block_size=BS, paths=("pallas",))
    finally:
        forced_decode.clear_cache()
    assert ref["check"] == "reference" and pallas["check"] == "pallas"
    assert not pallas["pass"], format_check(pallas)
    assert pallas["err_over_tolerance"] > 10
    assert pallas["kv_layer0_max_abs_diff"] == 0.0  # layer 0's k/v do not depend on attention


def test_a_path_that_raises_is_reported(setup):
    seen = []
    out = teacher_forced_check(*setup, block_size=BS, paths=("nope",), on_error=lambda p, e: seen.append((p, e)))
    assert [r["check"] for r in out] == ["reference"]
    assert seen[0][0] == "nope" and "path must be one of" in str(seen[0][1])
