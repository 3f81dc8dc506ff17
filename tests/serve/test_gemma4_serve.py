"""The paged engine serves Gemma 4 text (tests/fixtures/models/gemma4_text: 6 layers [sliding x 2, full] x 2,
window 4, the full layers' proportional rope, v norm, softmax scale 1 != H ** -0.5, layer scalars): four
concurrent requests of 3 .. 41 tokens give transformers' greedy tokens (expected.npz serve_prompt* /
serve_greedy*: scripts/make_gemma4_fixtures.py, float64), prefilled in chunks past the window; and the FP8 pool's
v bound is the v norm's sqrt(H) (serve/kv_fp8.py). gemma4_text_moe: the same with the MoE block beside the MLP
(few rows per decode step: the experts' gathered path). gemma4_text_global (full layers of their own shape, keys
as values) and gemma4_text_shared (+ KV-shared layers, per-layer input embeddings, the double-wide MLP): a pool
per KV shape, the KV-shared layers reading their source's pool rows (serve/kv_pools.py), with a prefix-cache hit."""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.generation.loop import generate
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.kv import PagedKernel
from surojax.models.targets import model_targets, site_stack
from surojax.peft.multi_lora import AdapterSlots
from surojax.serve.capacity import kv_bytes_per_token, num_kv_blocks
from surojax.serve.config import KVCacheDtype, KVPath
from surojax.serve.engine import Engine
from surojax.serve.kv_fp8 import FP8_DTYPE, FP8_MAX, FP8_REL_ERROR, kv_scales, layer_bounds, pool_bounds
from surojax.serve.kv_pools import kv_pools
from surojax.weights.hf_checkpoint import load_model
from tests.serve.adapters import forward_with_rows, random_adapter, serve_with_adapters
from tests.serve.configs import BUCKETS, engine_config
from tests.serve.test_kv_fp8 import PREFILL, _teacher_forced

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FIXTURE = FIXTURES / "gemma4_text"
SERVE = dict(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
             buckets=BUCKETS)


def _requests(fixture):
    exp = np.load(fixture / "expected.npz")
    return [exp[f"serve_prompt{i}"].tolist() for i in range(4)], [exp[f"serve_greedy{i}"].tolist() for i in range(4)]


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4_text_moe"])
def test_served_greedy_equals_transformers(name):
    prompts, want = _requests(FIXTURES / name)
    assert max(map(len, prompts)) > 2 * SERVE["max_num_batched_tokens"]  # a prompt of three chunks
    model = load_model(FIXTURES / name, dtype=jnp.float32, attention="xla")
    engine = Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, decode_steps=4))
    assert engine.generate(prompts, max_tokens=len(want[0])) == want


def test_fp8_kv_pool_bounds_the_normalised_values():
    """The v bound is sqrt(head_dim) = 4 on every layer (the projection's bound would not hold after the v norm);
    the engine builds its FP8 pool on it."""
    model = load_model(FIXTURE, dtype=jnp.float32, attention="xla")
    _, v = layer_bounds(model)
    np.testing.assert_allclose(v, 4.0)
    Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, kv_cache_dtype=KVCacheDtype.FP8))


def _serve_over_pools(engine, name):
    """Full layers of their own shape (a pool [2, slots, 1, 32] beside the sliding layers' [4, slots, 2, 16]) and
    KV-shared layers (no pool rows: gemma4_text_shared's pools hold 3 + 1 layers for its 6): transformers' greedy
    tokens for four concurrent requests (chunked prefill, multi-step decode), then again for prompt 3 continued by
    its first 6 greedy tokens beside prompt 1: its prompt's blocks hit the prefix cache (a continuing chunk reads
    them from both pools), and greedy continues where it was."""
    prompts, want = _requests(FIXTURES / name)
    layers = {"gemma4_text_global": (4, 2), "gemma4_text_shared": (3, 1)}[name]
    assert [k.shape for k in engine.runner.k_pool] == [(layers[0], 128, 2, 16), (layers[1], 128, 1, 32)]
    assert engine.generate(prompts, max_tokens=len(want[0])) == want, f"{name}: served greedy != transformers"
    assert engine.scheduler.num_multi_steps > 0
    hits = engine.kv.prefix_cache_hits
    assert engine.generate([prompts[3] + want[3][:6], prompts[1]], max_tokens=6) == [want[3][6:], want[1][:6]], \
        f"{name}: greedy after a prefix-cache hit"
    assert engine.kv.prefix_cache_hits - hits >= 40  # prompt 3's 10 full blocks at least


def test_pools_per_kv_shape_served_equal_transformers():
    """gemma4_text_global on the paged path: `_serve_over_pools`. gemma4_text_shared's pools (REDUCE: the decode
    rows' multiply + reduce) are served by test_runtime_lora_served_over_shared_layers_equals_the_merged_model's
    engine, its base rows (slot 0) on the same requests."""
    model = load_model(FIXTURES / "gemma4_text_global", dtype=jnp.float32, attention="xla")
    _serve_over_pools(Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, decode_steps=4)),
                      "gemma4_text_global")


def test_kv_shared_layers_take_no_pool_memory():
    """gemma4_text_shared: the KV-shared layers 4 (sliding, reads layer 3) and 5 (full, reads layer 2) have no pool
    rows, so a token costs the 3 sliding + 1 full layers that compute keys / values, and the memory budget holds
    more blocks than with the same layers unshared."""
    hf = json.loads((FIXTURES / "gemma4_text_shared" / "config.json").read_text())
    shared, unshared = ModelConfig.from_hf(hf), ModelConfig.from_hf(hf | {"num_kv_shared_layers": 0})
    pools = [(p.part, p.rows, p.num_layers) for p in kv_pools(shared)]
    assert pools == [("layers", (0, 1, 2, 2), 3), ("global_layers", (0, 0), 1)]
    assert kv_bytes_per_token(shared, jnp.float32) == 2 * (3 * 2 * 16 + 1 * 1 * 32) * 4
    assert kv_bytes_per_token(unshared, jnp.float32) == 2 * (4 * 2 * 16 + 2 * 1 * 32) * 4

    class Device:  # 1 MiB free for the pool: 0.5 MiB of it at kv_share 0.5
        def memory_stats(self):
            return {"bytes_limit": 2**20, "bytes_in_use": 0}

    blocks = [num_kv_blocks(c, jnp.float32, 4, 64, memory_utilization=1.0, device=Device()) for c in (shared, unshared)]
    assert blocks == [2**19 // (4 * 1024), 2**19 // (4 * 1536)]


def test_reference_path_is_refused_by_name():
    """The reference KV path (one dense view over one pool) refuses a model with pools of two shapes."""
    model = load_model(FIXTURES / "gemma4_text_global", dtype=jnp.float32, attention="xla")
    with pytest.raises(ValueError, match="kv_path reference serves one KV pool"):
        Engine(model, engine_config(**SERVE, kv_path=KVPath.REFERENCE))


def test_fp8_bounds_of_the_global_stack_come_from_its_own_projections():
    """gemma4_text_global's full layers (`global_layers`: head_dim 32, one kv head, keys as values) have pool rows
    of their own, bounded from their own stack (`layer_bounds(model, "global_layers")`): every |k| / |v| each pool
    row holds after random tokens ran through the fp32 pools is within its row's bound; the global v bound is their
    v norm's sqrt(32), the sliding layers' sqrt(16); halving the global W_k halves the global k bounds only."""
    model = load_model(FIXTURES / "gemma4_text_global", dtype=jnp.float32, attention="xla")
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, model.cfg.vocab_size, (2, 32)), jnp.int32)
    _, k, v = _teacher_forced(model, tokens, model.dtype, None, PagedKernel.GATHER)
    bounds = pool_bounds(model)
    assert [len(b) for b, _ in bounds] == [p.num_layers for p in kv_pools(model.cfg)] == [4, 2]
    for (k_bound, v_bound), k_pool, v_pool in zip(bounds, k, v, strict=True):
        assert (np.abs(np.asarray(k_pool)).max(axis=(1, 2, 3)) <= k_bound).all()
        assert (np.abs(np.asarray(v_pool)).max(axis=(1, 2, 3)) <= v_bound).all()
    np.testing.assert_allclose(bounds[0][1], 4.0)
    np.testing.assert_allclose(bounds[1][1], np.sqrt(32))
    w_k = model.global_layers.attn.k_proj.kernel  # its bound is the projection's here (below sqrt(32) max|w|)
    w_k.set_value(w_k.get_value() * 0.5)
    after = pool_bounds(model)
    np.testing.assert_array_equal(after[0][0], bounds[0][0])
    np.testing.assert_allclose(after[1][0], bounds[1][0] * 0.5, rtol=1e-5)


def test_fp8_pools_per_kv_shape_within_the_stated_bound():
    """gemma4_text_shared over FP8 pools (sliding layers; full layers of their own shape, keys as values; KV-shared
    layers reading their sources' rows): the scales follow the pools (one `KVScales` per pool, a scale per pool
    row: 3 + 1 for 6 layers); teacher-forced through the pools as the server builds them (`paged_cache`) nothing
    saturates and the logits stay within test_kv_fp8's stated bound of the plain forward's (2 L u of their spread;
    measured <= 0.53 of it, the greedy token agreeing on 71% of the positions of this random fixture, as on
    gemma4_text's one pool).
    The engine serves over them: a prompt continued by its first greedy tokens hits both pools' FP8 blocks in the
    prefix cache, and greedy continues where it was."""
    model = load_model(FIXTURES / "gemma4_text_shared", dtype=jnp.float32, attention="xla")
    scales = kv_scales(model)
    assert [len(s.k) for s in scales] == [len(s.v) for s in scales] == [p.num_layers for p in kv_pools(model.cfg)]
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, model.cfg.vocab_size, (2, 32)), jnp.int32)
    got, k8, v8 = _teacher_forced(model, tokens, FP8_DTYPE, scales, PagedKernel.GATHER)
    # the reference: the plain forward (no cache) at the positions whose next token was teacher-forced
    ref = np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens))[:, PREFILL - 1:-1]
    assert ref.shape == got.shape
    for pool in (*k8, *v8):
        codes = np.abs(np.asarray(pool.astype(jnp.float32)))
        assert pool.dtype == FP8_DTYPE and not np.isnan(codes).any() and codes.max() < FP8_MAX
    spread = ref.max(axis=-1) - ref.min(axis=-1)
    err = np.abs(got - ref).max(axis=-1)
    assert (err <= 2 * model.cfg.num_layers * FP8_REL_ERROR * spread).all(), (err / spread).max()
    assert err.max() > 0

    prompts, _ = _requests(FIXTURES / "gemma4_text_shared")
    engine = Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, decode_steps=4,
                                         kv_cache_dtype=KVCacheDtype.FP8))
    assert [k.dtype for k in engine.runner.k_pool] == [FP8_DTYPE] * 2 and engine.runner.kv_scales == scales
    first = engine.generate(prompts, max_tokens=8)
    hits = engine.kv.prefix_cache_hits
    assert engine.generate([prompts[3] + first[3][:4], prompts[1]], max_tokens=4) == [first[3][4:], first[1][:4]]
    assert engine.kv.prefix_cache_hits - hits >= 40  # prompt 3's 10 full blocks at least


def _shared_model():
    """gemma4_text_shared's config with global_head_dim = head_dim, no attention_k_eq_v (no full layers of their own
    shape: the paged engine serves it), random weights: stacks `layers` and `shared_layers`, per-layer inputs."""
    hf = json.loads((FIXTURES / "gemma4_text_shared" / "config.json").read_text())
    hf = {k: v for k, v in hf.items() if k != "per_layer_config"} | {"global_head_dim": 16, "attention_k_eq_v": False}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.global_attention is None and cfg.kv_shared_layers == 2 and cfg.per_layer_input_size == 8
    return Decoder(cfg, attention="xla", rngs=nnx.Rngs(0))


def test_shared_layers_and_per_layer_inputs_served_equal_generate():
    """Per-layer input embeddings and KV-shared layers without full layers of their own shape (gemma4_text_shared's
    config with global_head_dim = head_dim, no attention_k_eq_v; random weights): the paged engine's greedy tokens
    equal `generate`'s (which equals transformers on the fixture itself: test_hf_parity). One pool, the shared
    layers reading their sources' rows (4 pool layers for 6); an FP8 pool's scales: one per pool row. Single-step
    decode: the KV-shared layers in the multi-step call are
    test_runtime_lora_served_over_shared_layers_equals_the_merged_model's."""
    model = _shared_model()
    prompts, _ = _requests(FIXTURES / "gemma4_text_shared")
    want = generate(model, prompts, 12)
    engine = Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED))
    assert engine.runner.k_pool.shape == (4, 128, 2, 16)
    assert engine.generate(prompts, max_tokens=12) == want
    assert len(kv_scales(model).k) == 4


def test_runtime_lora_slots_on_every_stack_equal_the_merged_forward(tmp_path):
    """gemma4_text_global at the model level: the slots wrap `layers` and `global_layers` (no v_proj there: keys as
    values). An adapter on every target, saved
    under PEFT's model.layers.{i} names and loaded into a slot: a row with it gives the merged model's logits, a row
    without it the base's, in one forward."""
    model = load_model(FIXTURES / "gemma4_text_global", dtype=jnp.float32, attention="xla")
    merged = random_adapter(model, tmp_path / "a", seed=1, targets="all-linear")
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, model.cfg.vocab_size, size=(2, 12)))
    forward = nnx.jit(lambda m, x: m(x))
    want = np.concatenate([np.asarray(forward(merged, tokens[:1])), np.asarray(forward(model, tokens[1:]))])
    assert not np.allclose(want[:1], forward(model, tokens[:1]), atol=1e-3)  # the adapter changes the logits
    slots = AdapterSlots(model, max_loras=2, max_rank=8)
    assert {site_stack(k) for k in slots.modules} == {"layers", "global_layers"}
    assert "global_layers.v_proj" not in slots.modules and set(slots.modules) == set(model_targets(model))
    slots.load("a", tmp_path / "a")
    rows = jnp.asarray([slots.slot("a"), 0])  # row 0 the adapter, row 1 the base
    np.testing.assert_allclose(np.asarray(forward_with_rows(model, tokens, rows)), want, atol=1e-4, rtol=1e-4)


def test_runtime_lora_served_over_shared_layers_equals_the_merged_model(tmp_path):
    """gemma4_text_shared served by the paged engine (a pool per KV shape; REDUCE decode, multi-step) with LoRA
    slots in every stack: the sliding and full layers and their KV-shared copies (q / o and the MLP there; no k / v).
    (1) The fixture's requests on the base model (slot 0): `_serve_over_pools` (transformers' greedy tokens, a
    prefix-cache hit over both pools); (2) a row with the adapter decodes the merged model's greedy tokens, a row
    without it the base's, in one batch (prefill and multi-step decode)."""
    model = load_model(FIXTURES / "gemma4_text_shared", dtype=jnp.float32, attention="xla")
    merged = random_adapter(model, tmp_path / "a", seed=1, targets="all-linear")
    prompts = np.random.default_rng(0).integers(1, model.cfg.vocab_size, size=(2, 12)).tolist()
    adapted, base = generate(merged, prompts, 8), generate(model, prompts, 8)  # one compile: same shapes
    assert adapted[0] != base[0]
    slots = AdapterSlots(model, max_loras=1, max_rank=4)
    assert {site_stack(k) for k in slots.modules} == set(model.stacks)
    assert len(model.stacks) == 4, model.stacks
    engine = Engine(model, engine_config(**SERVE, kv_path=KVPath.REDUCE, decode_steps=4), lora=slots)
    _serve_over_pools(engine, "gemma4_text_shared")
    engine.load_lora("a", tmp_path / "a")
    steps = engine.scheduler.num_multi_steps
    assert serve_with_adapters(engine, prompts, ["a", None], 8) == [adapted[0], base[1]], "adapter rows != merged"
    assert engine.scheduler.num_multi_steps > steps  # the adapter rows in the multi-step call
