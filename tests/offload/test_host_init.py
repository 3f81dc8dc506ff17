"""`offload/host_init.random_placed_model` (the benchmarks' host-built weights) over a random quantised base: the
base comes from `quant.random_weights.random_weight` (the one builder of random quantised weights), one layer
repeated over L, placed in pinned host memory when streamed; the streamed run equals its host-built resident
pair (same weights)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.bench.train_bench import BenchConfig, build, run
from surojax.offload.host_init import random_quant_value
from surojax.offload.streaming import HOST_KIND
from surojax.quant.base import QuantFormat
from surojax.quant.random_weights import random_weight

SMALL = dict(shape="debug", seq=128, min_segment=16, batch=2, steps=1, repeats=1, warmup=1, recompute="full")


def _quant_leaves(state):
    return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantFormat))
            if isinstance(x, QuantFormat)]


def test_random_quant_value_is_one_random_weight_layer_repeated():
    abstract = jax.eval_shape(lambda: random_weight("q5_0", 64, 32, jax.random.key(0), (3,)))
    host = random_quant_value(abstract, seed=7, index=2)
    one = random_weight("q5_0", 64, 32, jax.random.fold_in(jax.random.key(7), 2), (1,))
    assert isinstance(host.data, np.ndarray) and host.data.shape == (3, 32, 2 * 22) and host.shape == (64, 32)
    for layer in range(3):
        np.testing.assert_array_equal(host.data[layer], np.asarray(one.data[0]))
    w = np.asarray(host.dequantize(jnp.float32))
    assert np.isfinite(w).all() and 0 < np.abs(w).max() < 1


def test_streamed_quantised_base_lives_on_the_host():
    setup = build(BenchConfig(**SMALL, offload_base=True, base_format="q4_0"))
    bases = _quant_leaves(setup.frozen)
    assert len(bases) == 7 and {q.name for q in bases} == {"q4_0"}  # every linear of the layers
    for q in bases:
        assert q.data.sharding.memory_kind == HOST_KIND
        w = np.asarray(q.dequantize(jnp.float32))
        assert np.isfinite(w).all() and 0 < np.abs(w).max() < 1


def test_streamed_quantised_base_equals_its_resident_pair_and_bad_format_is_refused():
    streamed = run(BenchConfig(**SMALL, offload_base=True, base_format="q8_0"), log=lambda _: None)
    resident = run(BenchConfig(**SMALL, init="host", base_format="q8_0"), log=lambda _: None)
    assert streamed["host_gib"] > 0 and resident["host_gib"] == 0
    assert np.isfinite(streamed["loss"]) and streamed["loss_first"] == resident["loss_first"]
    assert streamed["loss"] == resident["loss"]
    with pytest.raises(ValueError, match="--base-format 'q4_k'"):
        BenchConfig(shape="debug", base_format="q4_k").check()
