"""Engine (scheduler + paged runner over a KV pool) vs the plain-cache reference `surojax.generation.loop.generate`.

Greedy tokens must be identical alone, batched with chunked prefill, under preemption (small pool), and with
prefix-cache hits (a repeated system prompt, sequential and in the same step).
"""
from pathlib import Path

import numpy as np
import pytest

from surojax.generation.loop import generate
from surojax.serve.engine import Engine
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, SMALL, engine_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE, attention="xla")


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


SYSTEM = prompts(1, seed=4, lo=17, hi=18)[0]  # 17 tokens: 4 full blocks of 4
PROMPTS = {"alone": prompts(3, seed=1), "batched": prompts(8, seed=2), "stop": prompts(1, seed=3),
           "prefix": [SYSTEM + t for t in prompts(4, seed=5, lo=2, hi=6)]}


@pytest.fixture(scope="module")
def reference(model):
    """Each test's prompts and their plain-cache greedy tokens: every prompt of the module in one padded batch, so
    one prefill and one decode compilation (a row does not depend on its batch:
    tests/models/test_hf_parity.py::test_greedy_tokens_in_a_batch)."""
    everything = [p for ps in PROMPTS.values() for p in ps]
    tokens = iter(generate(model, everything, MAX_TOKENS))
    return {name: (ps, [next(tokens) for _ in ps]) for name, ps in PROMPTS.items()}


def test_alone_matches_generate(model, reference):
    ps, ref = reference["alone"]
    eng = Engine(model, engine_config(**SMALL))
    for p, r in zip(ps, ref):
        assert eng.generate([p], MAX_TOKENS) == [r]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks  # everything freed


def test_batched_chunked_preempted_matches_generate(model, reference):
    ps, ref = reference["batched"]
    # chunk 8 tokens, 32-token step budget, 16 blocks x 4 slots (< what 8 requests need) -> preemption
    eng = Engine(model, engine_config(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                                      max_model_len=64, chunk_size=8, buckets=BUCKETS))
    assert eng.generate(ps, MAX_TOKENS) == ref
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_stop_token_and_sampling_runs(model, reference):
    (p,), (ref,) = reference["stop"]
    stop = ref[3]
    eng = Engine(model, engine_config(**SMALL))
    out = eng.generate([p], MAX_TOKENS, stop_token_ids=(stop,))[0]
    assert out == ref[:ref.index(stop) + 1]
    a = eng.generate([p], MAX_TOKENS, temperature=1.0, top_k=50, seed=7)[0]
    b = eng.generate([p], MAX_TOKENS, temperature=1.0, top_k=50, seed=7)[0]
    assert a == b and len(a) == MAX_TOKENS  # per-request seed: reproducible


def test_prefix_cache_hit_same_tokens(model, reference):
    ps, ref = reference["prefix"]
    eng = Engine(model, engine_config(**SMALL))
    # sequential: the 2nd request onwards hits the system prompt's blocks
    assert [eng.generate([p], MAX_TOKENS)[0] for p in ps] == ref
    assert eng.kv.prefix_cache_hits >= 3 * 16
    # together in one step: later requests hit blocks the first writes in that same step (runner waves)
    eng2 = Engine(model, engine_config(**SMALL))
    assert eng2.generate(ps, MAX_TOKENS) == ref
    assert eng2.kv.prefix_cache_hits >= 3 * 16
    assert eng2.runner.num_deferred >= 3
