"""The teacher-forced decode checks (``benchmarks/decode_check.py``: the model over forced tokens, and each layer's
attention alone): every real decode path PASSES against the fp32 reference (fp32 on CPU: the Pallas kernel in
interpret mode; and in bf16, judged by the bf16 floor), and a wrong attention in the Pallas path (an
off-by-one length: the new token not attended; an output off by 1%) FAILS."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import surojax.models.kv.paged as paged
from surojax.weights.hf_checkpoint import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_check  # noqa: E402
from decode_check import attention_check, format_check, fp32_twin, teacher_forced_check  # noqa: E402
from forced_decode import forced_attention, forced_decode  # noqa: E402

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
    attn = {r["check"]: r for r in attention_check(*_no_tokens(setup), block_size=BS)}
    assert set(attn) == {"attention-gather", "attention-reduce", "attention-pallas"}
    assert all(r["pass"] for r in attn.values()), [format_check(r) for r in attn.values()]
    assert attn["attention-gather"]["attn_rel_err"] == 0.0 and 0 < attn["attention-pallas"]["attn_rel_err"] < 1e-5


def _no_tokens(setup):
    graphdef, state, k, v, _, start, table = setup
    return graphdef, state, k, v, start, table


def _wrong_pallas(monkeypatch, wrong):
    """The Pallas kernel replaced by wrong(kernel), seen by the pallas path only: a fresh jit of forced_decode /
    forced_attention (an empty cache, so traced again with the wrong kernel) serves path / kernel "pallas"; the
    reference and gather paths keep the programs the module already compiled (they never call
    paged_decode_attention: models/kv/paged.py), instead of all of them being compiled again."""
    monkeypatch.setattr(paged, "paged_decode_attention", wrong(paged.paged_decode_attention))

    def only_pallas(real, key, static):
        def traced_again(*a, **kw):  # a new function: nothing of jax's caches for `real` applies to it
            return real.__wrapped__(*a, **kw)

        fresh = jax.jit(traced_again, static_argnames=static)
        return lambda *a, **kw: (fresh if kw[key] == "pallas" else real)(*a, **kw)

    monkeypatch.setattr(decode_check, "forced_decode",
                        only_pallas(forced_decode, "path", ("graphdef", "path", "block_size", "unroll")))
    monkeypatch.setattr(decode_check, "forced_attention",
                        only_pallas(forced_attention, "kernel", ("graphdef", "kernel", "block_size")))


def _off_by_one(real):
    return lambda q, k, v, layer, table, lengths, **kw: real(q, k, v, layer, table, jnp.maximum(lengths - 1, 0), **kw)


def _one_percent(real):
    return lambda *a, **kw: real(*a, **kw) * 1.01


@pytest.mark.parametrize("wrong", [_off_by_one, _one_percent])
def test_a_wrong_kernel_fails(setup, monkeypatch, wrong):
    _wrong_pallas(monkeypatch, wrong)
    ref, pallas = teacher_forced_check(*setup, block_size=BS, paths=("pallas",))
    floor, attn = attention_check(*_no_tokens(setup), block_size=BS, paths=("pallas",))
    assert ref["check"] == "reference" and pallas["check"] == "pallas" and floor["check"] == "attention-gather"
    for r in (pallas, attn):
        assert not r["pass"], format_check(r)
        assert r["err_over_tolerance"] > 10
    assert pallas["kv_layer0_max_abs_diff"] == 0.0  # layer 0's k/v do not depend on attention


def test_bf16_judged_by_its_noise_floor(setup, monkeypatch):
    """In bf16 the real kernel passes (its rounding is the reference's kind) and the off-by-one still fails
    (its row of length 1 attends nothing)."""
    graphdef, state, k, v, tokens, start, table = setup
    g, s = fp32_twin(graphdef, state)  # the same structure; now cast to bf16
    model = nnx.merge(g, jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, s))
    model.dtype = jnp.bfloat16
    g16, s16 = nnx.split(model)
    args16 = (g16, s16, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    ok = attention_check(*args16, start, table, block_size=BS, paths=("pallas",))[1]
    assert ok["pass"] and 1e-3 < ok["attn_noise"] < 5e-2, format_check(ok)
    _wrong_pallas(monkeypatch, _off_by_one)
    bad = attention_check(*args16, start, table, block_size=BS, paths=("pallas",))[1]
    assert not bad["pass"] and bad["worst_row_length"] == 1, format_check(bad)


def test_a_path_that_raises_is_reported(setup):
    seen = []
    out = teacher_forced_check(*setup, block_size=BS, paths=("nope",), on_error=lambda p, e: seen.append((p, e)))
    assert [r["check"] for r in out] == ["reference"]
    assert seen[0][0] == "nope" and "path must be one of" in str(seen[0][1])
