"""The paged engine serves Gemma 3 text (tests/fixtures/models/gemma3_text: 5 layers [sliding x 2, full] +
[sliding x 2], window 4, the sliding layers on their own rope base, query_pre_attn_scalar 24 != head_dim): four
concurrent requests of 3 .. 41 tokens give transformers' greedy tokens (expected.npz serve_prompt* /
serve_greedy*: scripts/make_gemma3_fixtures.py, float64). The 26- and 41-token prompts are prefilled in chunks
while the others decode, so every sliding layer reads its window across block and chunk boundaries of the pool;
the global layers' softmax scale is not H ** -0.5, which the paged decode kernel cannot take (they gather)."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from surojax.serve.config import KVCacheDtype, KVPath
from surojax.serve.engine import Engine
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, engine_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "gemma3_text"
SERVE = dict(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
             buckets=BUCKETS)


def test_served_greedy_equals_transformers():
    exp = np.load(FIXTURE / "expected.npz")
    prompts = [exp[f"serve_prompt{i}"].tolist() for i in range(4)]
    want = [exp[f"serve_greedy{i}"].tolist() for i in range(4)]
    assert max(map(len, prompts)) > 2 * SERVE["max_num_batched_tokens"]  # a prompt of three chunks
    model = load_model(FIXTURE, dtype=jnp.float32, attention="xla")
    engine = Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, decode_steps=4))
    assert engine.generate(prompts, max_tokens=len(want[0])) == want


def test_fp8_kv_pool_is_refused_by_name():
    """The FP8 pool's scale bound (serve/kv_fp8.py) reads a norm weight as the scale; Gemma's are 1 + w."""
    model = load_model(FIXTURE, dtype=jnp.float32, attention="xla")
    with pytest.raises(ValueError, match=r"FP8 KV pool is not supported with \(1 \+ w\) RMSNorms"):
        Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, kv_cache_dtype=KVCacheDtype.FP8))
