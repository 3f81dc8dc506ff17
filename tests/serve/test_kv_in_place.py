"""``kv_in_place`` (``Decoder.hidden_states(runner=CarriedCacheScan())``): the cache rides in the layer scan's carry and
each layer writes its new k/v in place. Same values as the scan-input/output path, and the engine gives the same
tokens with it (single steps and multi-step decode), and with the layer loop unrolled (``unroll_layers``)."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from surojax.models.kv import KVCache
from surojax.models.layer_runner import CarriedCacheScan
from surojax.serve.engine import Engine
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, engine_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE, attention="xla")


def test_cache_in_carry_equals_scan_outputs(model):
    B, S, T = 2, 32, 5
    toks = jnp.asarray(np.random.default_rng(0).integers(1, 500, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T)).astype(jnp.int32)
    seg = jnp.ones((B, T), jnp.int32).at[1, 4].set(0)  # a padded token
    cache = KVCache.empty(model.cfg, B, S, jnp.float32)
    h1, c1, _ = model.hidden_states(toks, pos, seg, cache=cache)
    h2, c2, _ = model.hidden_states(toks, pos, seg, cache=cache, runner=CarriedCacheScan())
    for a, b in ((h1, h2), (c1.k, c2.k), (c1.v, c2.v), (c1.lengths, c2.lengths), (c1.segment_ids, c2.segment_ids)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_engine_tokens_unchanged(model):
    """In place, with multi-step decode (and its single-step prefill) == the default path, single steps."""
    rng = np.random.default_rng(1)
    ps = [rng.integers(1, 500, size=n).tolist() for n in (9, 6)]
    outs = []
    for k, in_place, unroll in ((1, False, False), (4, True, False), (4, True, True)):
        config = engine_config(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=128,
                               max_model_len=96, buckets=BUCKETS, decode_steps=k, kv_in_place=in_place,
                               unroll_layers=unroll)
        eng = Engine(model, config)
        outs.append(eng.generate(ps, 7))
        assert eng.runner.num_calls > 0
    assert outs[0] == outs[1] == outs[2]
    assert len(outs[0][0]) == 7
