"""gpt_oss attention: sink logits in the softmax denominator (every attention path: xla, the cudnn backend's
static fallback, the dense and paged KV caches with the Pallas kernel requested), per-layer windows as the layer
types of the decoder's layer pattern (a 4-layer model against a layer-by-layer reference with static windows), the o_proj bias, and the
layer_types <-> layer_windows reading. References are written out here in numpy after transformers' gpt_oss
`eager_attention_forward` (softmax over [scores, sink], sink column dropped)."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig, ModelConfigError
from surojax.models.decoder import Block, Decoder
from surojax.models.kv import AttendSpec, KVCache, PagedKernel, PagedKVCache
from surojax.models.layers.attention import Attention, xla_attention
from surojax.models.layers.rope import inv_freq, rope_cos_sin

B, T, N, K, H = 2, 6, 4, 2, 8
FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"


def sink_reference(q, k, v, mask, sinks):
    """numpy, float64: q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S], sinks [N] -> [B, T, N, H]."""
    G = q.shape[2] // k.shape[2]
    out = np.zeros(q.shape)
    for b, t, n in np.ndindex(q.shape[:3]):
        s = k[b, :, n // G] @ q[b, t, n] * H ** -0.5
        logits = np.concatenate([np.where(mask[b, t], s, -np.inf), [sinks[n]]])
        p = np.exp(logits - logits.max())
        out[b, t, n] = (p / p.sum())[:-1] @ v[b, :, n // G]
    return out


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def tiny(**changes) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=N,
                num_kv_heads=K, head_dim=H, attention_bias=True, o_proj_bias=True, attention_sinks=True,
                sliding_window=2, layer_windows=(2, None, 2, None))
    return ModelConfig(**(base | changes))


def test_xla_attention_with_sinks_matches_the_eager_reference():
    q, k, v = rand(B, T, N, H, seed=1), rand(B, T, K, H, seed=2), rand(B, T, K, H, seed=3)
    sinks = 2.0 * rand(N, seed=4)  # large enough that the sink takes a visible share
    mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    mask[1, 4:] = False  # two padding queries that see nothing: all their mass goes to the sink -> zeros
    got = xla_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), H ** -0.5,
                        jnp.asarray(sinks))
    want = sink_reference(q, k, v, mask, sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    assert np.all(np.asarray(got)[1, 4:] == 0)
    plain = xla_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), H ** -0.5)
    assert np.abs(np.asarray(plain)[0] - want[0]).max() > 1e-2  # the sinks matter at these values


def test_sink_gradient_matches_finite_differences():
    q, k, v = (jnp.asarray(rand(1, 3, N, H, seed=s)) for s in (1, 2, 3))
    k, v = k[:, :, :K], v[:, :, :K]
    mask = jnp.asarray(np.tril(np.ones((3, 3), bool))[None])
    sinks = jnp.asarray(rand(N, seed=4))
    loss = jax.jit(lambda s: jnp.sum(xla_attention(q, k, v, mask, H ** -0.5, s) ** 2))  # one compilation, 2 calls
    eps, e0 = 1e-3, np.eye(N, dtype=np.float32)[2]
    fd = (float(loss(sinks + eps * e0)) - float(loss(sinks - eps * e0))) / (2 * eps)
    assert float(jax.jit(jax.grad(loss))(sinks)[2]) == pytest.approx(fd, rel=2e-3)


def _context(seed=0):
    """A decode step: rows hold 5 and 9 tokens; the new token attends to all of them and itself."""
    lengths, S, L = np.array([5, 9]), 16, 2
    ctx_k, ctx_v = rand(L, B, S, K, H, seed=seed), rand(L, B, S, K, H, seed=seed + 1)
    q, new_k, new_v = rand(B, 1, N, H, seed=seed + 2), rand(B, 1, K, H, seed=seed + 3), rand(B, 1, K, H, seed=seed + 4)
    full_k, full_v = ctx_k[1].copy(), ctx_v[1].copy()
    full_k[[0, 1], lengths], full_v[[0, 1], lengths] = new_k[:, 0], new_v[:, 0]
    mask = (np.arange(S)[None, None, :] <= lengths[:, None, None])
    return lengths, ctx_k, ctx_v, q, new_k, new_v, sink_reference(q, full_k, full_v, mask, SINKS)


SINKS = np.array([1.5, -0.5, 3.0, 0.0], np.float32)


def test_dense_cache_attends_with_sinks():
    lengths, ctx_k, ctx_v, q, new_k, new_v, want = _context()
    S = ctx_k.shape[2]
    filled = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
    cache = KVCache(jnp.asarray(ctx_k), jnp.asarray(ctx_v), jnp.asarray(filled),
                    jnp.asarray(np.where(filled, np.arange(S), 0), jnp.int32), jnp.asarray(lengths, jnp.int32))
    meta, cache = cache.step(jnp.ones((B, 1), jnp.int32), jnp.asarray(lengths[:, None], jnp.int32))
    spec = AttendSpec(xla_attention, H ** -0.5, None, jnp.asarray(SINKS))
    view = cache.carried()
    out, _ = view.__class__(view.k, view.v, jnp.int32(1)).update_and_attend(q, new_k, new_v, meta, spec)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)


@pytest.mark.parametrize("kernel", [PagedKernel.PALLAS, PagedKernel.REDUCE, PagedKernel.GATHER])
def test_paged_pool_attends_with_sinks_whatever_kernel_is_asked(kernel):
    """The Pallas decode kernel has no sinks: asked for, it is not used (the gather path serves the layer)."""
    lengths, ctx_k, ctx_v, q, new_k, new_v, want = _context()
    bs, nb = 4, 4
    table = np.arange(B * nb, dtype=np.int32).reshape(B, nb)  # row b owns blocks b*nb ..: pool slot = b*S + pos
    pool_k, pool_v = ctx_k.reshape(2, B * nb * bs, K, H), ctx_v.reshape(2, B * nb * bs, K, H)
    cache = PagedKVCache(jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table), jnp.asarray(lengths, jnp.int32),
                         bs, kernel)
    meta, cache = cache.step(jnp.ones((B, 1), jnp.int32), jnp.asarray(lengths[:, None], jnp.int32))
    view = cache.carried()
    spec = AttendSpec(xla_attention, H ** -0.5, None, jnp.asarray(SINKS))
    out, _ = view.__class__(view.k, view.v, jnp.int32(1), bs, kernel).update_and_attend(q, new_k, new_v, meta, spec)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)


def _inputs(cfg, seed=0):
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.asarray(np.array([list(range(T)), [0, 1, 2, 0, 1, 2]]), jnp.int32)  # row 1: two packed seqs
    segments = jnp.asarray(np.array([[1] * T, [1, 1, 1, 2, 2, 2]]), jnp.int32)
    return tokens, positions, segments


def layer_by_layer(model: Decoder, tokens, positions, segments):
    """The reference: each layer as its own Block built from a config with that layer's STATIC window."""
    cfg = model.cfg
    h = jnp.take(model.embed.embedding[...], tokens, axis=0)
    cos, sin = rope_cos_sin(positions, inv_freq(cfg), jnp.float32)
    state = nnx.state(model.layers)
    for i in range(cfg.num_layers):
        layer_cfg = cfg.replace(layer_windows=None, sliding_window=cfg.layer_window(i))
        block = Block(layer_cfg, attention="xla", param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        nnx.update(block, jax.tree.map(lambda x: x[i], state))
        h, _, _ = block(h, cos, sin, segments, positions)
    return model.logits(model.final_norm(h))


@pytest.mark.parametrize("backend", ["xla", "cudnn"])
def test_alternating_windows_equal_static_windows_layer_by_layer(backend):
    """backend cudnn on CPU in fp32: each layer type's static window computes the xla reference with that window,
    so this checks that the layer pattern hands each layer its window."""
    cfg = tiny(attention_sinks=False) if backend == "cudnn" else tiny()
    model = Decoder(cfg, attention=backend, rngs=nnx.Rngs(0))
    tokens, positions, segments = _inputs(cfg)
    run = nnx.jit(lambda m, *args: m(*args))  # one compilation per model (eagerly, one per op)
    got = run(model, tokens, positions, segments)
    want = nnx.jit(layer_by_layer)(model, tokens, positions, segments)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    uniform = Decoder(cfg.replace(layer_windows=None, sliding_window=None), attention=backend, rngs=nnx.Rngs(0))
    assert np.abs(np.asarray(run(uniform, tokens, positions, segments)) - np.asarray(got)).max() > 1e-4  # windows bite


def test_cudnn_backend_with_sinks_takes_the_xla_path():
    """bf16 on CPU: had the layer called cuDNN it would fail here; it equals the xla backend exactly."""
    cfg = tiny()
    x = jnp.asarray(rand(B, T, cfg.hidden_size), jnp.bfloat16)
    _, positions, segments = _inputs(cfg)
    cos, sin = rope_cos_sin(positions, inv_freq(cfg), jnp.bfloat16)
    outs = []
    for backend in ("cudnn", "xla"):
        att = Attention(cfg, backend=backend, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        outs.append(np.asarray(att(x, cos, sin, segments, positions, window=2)[0], np.float32))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_generation_with_a_cache_equals_the_full_forward():
    cfg = tiny()
    model = Decoder(cfg, attention="xla", rngs=nnx.Rngs(1))
    run = nnx.jit(lambda m, *args, cache=None: m(*args, cache=cache))  # one compilation per shape (eager: per op)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
    full = run(model, jnp.asarray(tokens))
    cache = KVCache.empty(cfg, 1, 8, jnp.float32)
    pre, cache = run(model, jnp.asarray(tokens[:, :4]), cache=cache)
    steps = [np.asarray(pre)]
    for t in range(4, T):  # both decode steps share one compilation
        out, cache = run(model, jnp.asarray(tokens[:, t:t + 1]), jnp.full((1, 1), t, jnp.int32),
                         jnp.ones((1, 1), jnp.int32), cache=cache)
        steps.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(full), atol=1e-5)


def test_o_proj_bias_and_sinks_are_parameters():
    cfg = tiny()
    model = Decoder(cfg, attention="xla", rngs=nnx.Rngs(0))
    assert model.layers.attn.o_proj.bias[...].shape == (4, cfg.hidden_size)
    assert model.layers.attn.sinks[...].shape == (4, N)
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    plain = Decoder(tiny(o_proj_bias=False, attention_sinks=False), attention="xla", rngs=nnx.Rngs(0))
    assert plain.layers.attn.o_proj.bias is None and plain.layers.attn.sinks is None


def qwen3_hf(**changes) -> dict:
    return json.loads((FIXTURES / "qwen3" / "config.json").read_text()) | changes


def test_layer_types_become_layer_windows_and_back():
    hf = qwen3_hf(sliding_window=3, use_sliding_window=True, layer_types=["sliding_attention", "full_attention"])
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.sliding_window, cfg.layer_windows) == (3, (3, None))
    out = cfg.to_hf()
    assert out["layer_types"] == hf["layer_types"] and out["sliding_window"] == 3
    assert ModelConfig.from_hf(out) == cfg
    plain = ModelConfig.from_hf(qwen3_hf())  # all full_attention, as transformers writes qwen2 / qwen3
    assert (plain.sliding_window, plain.layer_windows) == (None, None)
    assert plain.to_hf()["layer_types"] == ["full_attention"] * 2
    off = ModelConfig.from_hf(hf | {"use_sliding_window": False})  # transformers: sliding layers see everything
    assert (off.sliding_window, off.layer_windows) == (None, None)
    with pytest.raises(ModelConfigError, match="chunked_attention"):
        ModelConfig.from_hf(hf | {"layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ModelConfigError, match="layer_types has 1 entries"):
        ModelConfig.from_hf(hf | {"layer_types": ["full_attention"]})
