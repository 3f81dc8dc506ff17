"""Per-stack caches in the layer runner and generation with the hybrid cache, on toy layers: a KV-using attention
layer (stack `layers`, a `KVCache` part) and a state-using Gated DeltaNet layer (stack `linear_layers`, a
`StateCache` part, layers/deltanet_cache.py). The scan (per-layer and carried views, patterns with a remainder in
either stack) equals an unrolled Python loop over the same layers, caches included; greedy generation with the
hybrid cache (right-padded prompts) equals recomputing every sequence from scratch without a cache."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.generation.loop import empty_cache, generate
from surojax.models.kv import AttendSpec, HybridCache, KVCache, StateCache, StateShape, attention_mask
from surojax.models.kv.recurrent import conv_state_shape, recurrent_state_shape
from surojax.models.layer_runner import LayerPattern, LayerScan, LayerType
from surojax.models.layers.attention import xla_attention
from surojax.models.layers.deltanet_cache import deltanet_mix

D, N, HD, V = 8, 2, 4, 13  # hidden, attention heads x head dim (= D), vocabulary
SHAPE = StateShape(num_key_heads=1, key_head_dim=4, num_value_heads=2, value_head_dim=4, conv_kernel=3)
SPEC = AttendSpec(xla_attention, HD ** -0.5)


def _w(rngs, *shape):
    return nnx.Param(0.4 * jax.random.normal(rngs.params(), shape))


class ToyAttention(nnx.Module):
    """h + causal attention (no rope): through its KV view when it has one."""

    def __init__(self, rngs):
        self.wq, self.wk, self.wv = _w(rngs, D, N * HD), _w(rngs, D, N * HD), _w(rngs, D, N * HD)

    def __call__(self, h, segment_ids, positions, *, kv=None, kv_meta=None):
        B, T, _ = h.shape
        q, k, v = ((h @ w[...]).reshape(B, T, N, HD) for w in (self.wq, self.wk, self.wv))
        if kv is not None:
            out, kv = kv.update_and_attend(q, k, v, kv_meta, SPEC)
        else:
            out = xla_attention(q, k, v, attention_mask(segment_ids, segment_ids, positions, positions), SPEC.scale)
        return h + out.reshape(B, T, N * HD), kv, None


class ToyDeltaNet(nnx.Module):
    """h + Gated DeltaNet mixing of h's projections (uncached, or from its state view)."""

    def __init__(self, rngs):
        self.w_qkv, self.w_a, self.w_b = _w(rngs, D, SHAPE.conv_dim), _w(rngs, D, 2), _w(rngs, D, 2)
        self.conv = _w(rngs, SHAPE.conv_dim, 1, SHAPE.conv_kernel)
        self.w_o = _w(rngs, SHAPE.num_value_heads * SHAPE.value_head_dim, D)

    def __call__(self, h, segment_ids, positions, *, kv=None, kv_meta=None):
        B, T, _ = h.shape
        g = -jax.nn.softplus(h @ self.w_a[...])
        beta = jax.nn.sigmoid(h @ self.w_b[...])
        o, kv = deltanet_mix(h @ self.w_qkv[...], g, beta, segment_ids, conv_weight=self.conv[...], shape=SHAPE,
                             state=kv)
        return h + o.reshape(B, T, -1) @ self.w_o[...], kv, None


def stacked(cls, n, seed):
    return nnx.vmap(lambda k: cls(nnx.Rngs(params=k)), in_axes=0, out_axes=0)(jax.random.split(jax.random.key(seed), n))


FULL, LINEAR = LayerType("layers"), LayerType("linear_layers")
PATTERNS = {  # [linear, linear, full] + [linear, linear]; [full, linear] + [full]
    "linear_remainder": LayerPattern((LINEAR, LINEAR, FULL), 5),
    "full_remainder": LayerPattern((FULL, LINEAR), 3),
}


def _stacks(pattern):
    return {"layers": stacked(ToyAttention, pattern.rows("layers"), 0),
            "linear_layers": stacked(ToyDeltaNet, pattern.rows("linear_layers"), 1)}


def _cache(pattern, B, S, filled, rng):
    """A cache with `filled` tokens already in every row (random k/v and states: a sequence under way)."""
    rand = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    L = pattern.rows("layers")
    seg = jnp.asarray(np.arange(S)[None, :] < filled, jnp.int32).repeat(B, 0)
    kv = KVCache(rand(L, B, S, N, HD), rand(L, B, S, N, HD), seg, jnp.where(seg > 0, jnp.arange(S), 0),
                 jnp.full((B,), filled, jnp.int32))
    M = pattern.rows("linear_layers")
    state = StateCache(rand(M, *conv_state_shape(SHAPE, B)), rand(M, *recurrent_state_shape(SHAPE, B)))
    return HybridCache(kv, state)


def python_loop(pattern, stacks, h, consts, cache, meta):
    """The reference: layer i of type types[i % P] reads the next row of its stack's parameters and cache part
    (the part's per-layer view at that row), written back at that row."""
    parts = {"layers": cache.kv, "linear_layers": cache.state}
    rows = {name: 0 for name in parts}
    for i in range(pattern.num_layers):
        name = pattern.types[i % pattern.period].stack
        r = rows[name]
        graphdef, state = nnx.split(stacks[name])
        layer = nnx.merge(graphdef, jax.tree.map(lambda x: x[r], state))
        view = jax.tree.map(lambda x: x[r], parts[name].per_layer())
        h, view, _ = layer(h, *consts, kv=view, kv_meta=meta)
        whole = parts[name].per_layer()
        parts[name] = parts[name].with_layers(jax.tree.map(lambda a, x: a.at[r].set(x), whole, view))
        rows[name] += 1
    assert rows == {name: pattern.rows(name) for name in parts}
    return h, HybridCache(parts["layers"], parts["linear_layers"])


@pytest.mark.parametrize("name", list(PATTERNS))
def test_per_stack_caches_equal_a_python_loop(name):
    pattern = PATTERNS[name]
    stacks, rng = _stacks(pattern), np.random.default_rng(0)
    B, T, S, filled = 2, 3, 8, 2
    cache = _cache(pattern, B, S, filled, rng)
    h = jnp.asarray(rng.standard_normal((B, T, D)).astype(np.float32))
    seg = jnp.asarray([[1, 1, 1], [1, 1, 0]], jnp.int32)  # row 1: one padding token
    pos = jnp.broadcast_to(filled + jnp.arange(T, dtype=jnp.int32), (B, T))
    meta, cache = cache.step(seg, pos)
    want_h, want_cache = jax.jit(lambda c, h: python_loop(pattern, stacks, h, (seg, pos), c, meta))(cache, h)
    for runner in (LayerScan(), LayerScan(carry_cache=True)):
        got = jax.jit(lambda c, h, r=runner: r.run(pattern, stacks, h, (seg, pos), cache=c, kv_meta=meta))(cache, h)
        np.testing.assert_allclose(np.asarray(got.hidden), np.asarray(want_h), atol=1e-5, rtol=1e-5,
                                   err_msg=str(runner))
        for a, b in zip(jax.tree.leaves(got.cache), jax.tree.leaves(want_cache), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=str(runner))
    # the check can fail: every linear row's state moved, every attention row's new slots were written
    assert float(jnp.min(jnp.max(jnp.abs(want_cache.state.recurrent - cache.state.recurrent), axis=(1, 2, 3, 4)))) > 0
    assert float(jnp.min(jnp.max(jnp.abs(want_cache.kv.k - cache.kv.k)[:, :, filled], axis=(1, 2, 3)))) > 0


def test_caches_that_do_not_fit_the_pattern_are_refused():
    pattern = PATTERNS["full_remainder"]
    cache = _cache(pattern, 1, 4, 0, np.random.default_rng(0)).kv
    meta, cache = cache.step(jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
    consts = (jnp.ones((1, 1), jnp.int32),) * 2
    with pytest.raises(ValueError, match="one part per stack"):
        LayerScan().run(pattern, _stacks(pattern), jnp.zeros((1, 1, D)), consts, cache=cache, kv_meta=meta)
    wrong = HybridCache(cache, StateCache.empty(2, 1, SHAPE, jnp.float32))  # 2 linear layers' states, 1 layer
    with pytest.raises(ValueError, match="'linear_layers' holds \\[2\\] layers; .* 1"):
        LayerScan().run(pattern, _stacks(pattern), jnp.zeros((1, 1, D)), consts, cache=wrong, kv_meta=meta)


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """What generation reads of a model's config: the attention cache's layout and the hybrid's `linear_attention`
    head layout (the model's `LinearAttentionConfig` has a `StateShape`'s fields)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    linear_attention: StateShape | None = None


class ToyHybrid(nnx.Module):
    """A two-stack decoder as generation drives it: embed, the layer pattern, a head."""

    def __init__(self, pattern):
        self.cfg = ToyConfig(pattern.num_layers, N, HD, linear_attention=SHAPE)
        self.dtype = jnp.float32
        self.pattern = pattern
        self.embed, self.head = _w(nnx.Rngs(params=5), V, D), _w(nnx.Rngs(params=6), D, V)
        stacks = _stacks(pattern)
        self.layers, self.linear_layers = stacks["layers"], stacks["linear_layers"]

    @property
    def layer_pattern(self):
        return self.pattern

    def __call__(self, tokens, positions=None, segment_ids=None, *, cache=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        meta = None
        if cache is not None:
            meta, cache = cache.step(segment_ids, positions)
        out = LayerScan().run(self.pattern, {"layers": self.layers, "linear_layers": self.linear_layers},
                              self.embed[...][tokens], (segment_ids, positions), cache=cache, kv_meta=meta)
        logits = out.hidden @ self.head[...]
        return (logits, out.cache) if cache is not None else logits


def test_generation_with_the_hybrid_cache_equals_recomputing_without_one():
    model = ToyHybrid(PATTERNS["linear_remainder"])
    cache = empty_cache(model, 2, 7, jnp.float32)
    assert isinstance(cache, HybridCache) and cache.kv.k.shape[0] == 1 and cache.state.conv.shape[0] == 4
    prompts, new = [[3, 1, 4, 1, 5], [9, 2]], 5
    got = generate(model, prompts, new)
    # the reference: each whole sequence (prompt + tokens generated) once without a cache; causal, so position p's
    # logits are those of the sequence up to p: greedy picks each generated token there
    seqs = [p + g for p, g in zip(prompts, got)]
    tokens = np.zeros((2, max(map(len, seqs))), np.int32)
    segments = np.zeros_like(tokens)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)], segments[b, :len(s)] = s, 1
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda st, t, s: nnx.merge(graphdef, st)(t, segment_ids=s))(state, tokens, segments)
    for b, (prompt, tokens_b) in enumerate(zip(prompts, got)):
        assert len(tokens_b) == new
        assert tokens_b == np.argmax(np.asarray(logits[b, len(prompt) - 1:len(prompt) - 1 + new]), -1).tolist()
    assert len({t for row in got for t in row}) > 2  # not a constant output
