"""Gated DeltaNet's mixing with and without a cache (surojax/models/layers/deltanet_cache.py) against a float64 numpy
reference written out here: the causal conv1d over each sequence from zero history, SiLU, L2-normalised q / k
repeated to the value heads, the gated delta rule token by token. Cached: right-padded prompts prefilled in two
chunks then decoded token by token (both layer views) equal the reference over each whole sequence, states
included; uncached: packed rows reset at segment starts."""
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.models.kv import LayerState, StackedLayerState, StateCache, StateShape
from surojax.models.layers.deltanet_cache import deltanet_mix

SHAPE = StateShape(num_key_heads=1, key_head_dim=4, num_value_heads=2, value_head_dim=3, conv_kernel=4)
C, H = SHAPE.conv_dim, SHAPE.num_value_heads


def _inputs(rng, n):
    x = rng.standard_normal((n, C)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((n, H)))).astype(np.float32)  # -softplus: <= 0
    beta = (1 / (1 + np.exp(-rng.standard_normal((n, H))))).astype(np.float32)
    return x, g, beta


def reference(x, g, beta, w):
    """One sequence x [n, C] from zero state, conv weight [C, 1, K] -> (o [n, H, Dv], last K - 1 inputs, final
    state [H, Dk, Dv])."""
    x, g, beta, w = (np.asarray(a, np.float64) for a in (x, g, beta, w))
    w = w[:, 0]
    n, K = len(x), SHAPE.conv_kernel
    xin = np.concatenate([np.zeros((K - 1, C)), x])
    conv = np.stack([sum(w[:, j] * xin[t + j] for j in range(K)) for t in range(n)])
    conv = conv / (1 + np.exp(-conv))  # SiLU
    Hk, Dk, Dv = SHAPE.num_key_heads, SHAPE.key_head_dim, SHAPE.value_head_dim
    q, k = (conv[:, i * Hk * Dk:(i + 1) * Hk * Dk].reshape(n, Hk, Dk) for i in range(2))
    q, k = (np.repeat(a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6), H // Hk, axis=1) for a in (q, k))
    v = conv[:, 2 * Hk * Dk:].reshape(n, H, Dv)
    S, out = np.zeros((H, Dk, Dv)), []
    for t in range(n):
        S = S * np.exp(g[t])[:, None, None]
        pred = np.einsum("hk,hkv->hv", k[t], S)
        S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - pred))[:, None, :]
        out.append(np.einsum("hk,hkv->hv", q[t] * Dk ** -0.5, S))
    return np.stack(out), xin[-(K - 1):], S


@pytest.mark.parametrize("carried", [False, True])
def test_prefill_then_decode_equals_the_whole_sequence(carried):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((C, 1, SHAPE.conv_kernel)).astype(np.float32) * 0.5)
    prompts, new = [6, 3], 3  # row 1's prompt ends inside the first chunk: padding there and in the second
    seqs = [_inputs(rng, n + new) for n in prompts]
    cache = StateCache.empty(2, len(seqs), SHAPE, jnp.float32)
    cache = StateCache(cache.conv + 7.0, cache.recurrent + 7.0)  # layer 0 of 2: another layer's (must stay)
    cache = StateCache(cache.conv.at[1].set(0.0), cache.recurrent.at[1].set(0.0))  # layer 1: a fresh sequence
    view = StackedLayerState(cache.conv, cache.recurrent, jnp.int32(1)) if carried else \
        LayerState(cache.conv[1], cache.recurrent[1])
    outs = [[] for _ in seqs]

    def call(view, x, g, beta, seg):
        o, view = deltanet_mix(x, g, beta, seg, conv_weight=w, shape=SHAPE, state=view)
        for b in range(len(seqs)):
            outs[b].extend(np.asarray(o[b, :int(seg[b].sum())]))
        return view

    view = call(view, *_prompt_chunk(seqs, prompts, 0, 4))  # chunked prefill: two calls through the chunk rule
    view = call(view, *_prompt_chunk(seqs, prompts, 4, 6))  # row 1: all padding (its state must not move)
    for t in range(new):  # decode: one token per row through the recurrent step
        view = call(view, *[a[:, None] for a in _token(seqs, prompts, t)])
    conv, state = view.read()
    for b, (x, g, beta) in enumerate(seqs):
        o, last, S = reference(x, g, beta, w)
        np.testing.assert_allclose(np.stack(outs[b]), o, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(conv[b]), last, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state[b]), S, atol=1e-5, rtol=1e-5)
    if carried:  # the other layer's rows are untouched
        np.testing.assert_array_equal(np.asarray(view.conv[0]), np.asarray(cache.conv[0]))
        np.testing.assert_array_equal(np.asarray(view.recurrent[0]), np.asarray(cache.recurrent[0]))


def _prompt_chunk(seqs, prompts, lo, hi):
    """Prompt tokens lo .. hi - 1 of each row (fewer where its prompt ends), right-padded to hi - lo ->
    x, g, beta, segment ids."""
    parts = [tuple(a[min(lo, n):min(hi, n)] for a in s) for s, n in zip(seqs, prompts)]
    T = hi - lo
    out = [np.zeros((len(seqs), T) + a.shape[1:], np.float32) for a in parts[0]]
    seg = np.zeros((len(seqs), T), np.int32)
    for b, p in enumerate(parts):
        for o, a in zip(out, p):
            o[b, :len(a)] = a
        seg[b, :len(p[0])] = 1
        for o, junk in zip(out, (9.0, -1.0, 0.5)):  # padding x, g, beta that would show if they reached a state
            o[b, len(p[0]):] = junk
    return [jnp.asarray(a) for a in out] + [jnp.asarray(seg)]


def _token(seqs, prompts, t):
    """The t-th decoded token of each row: [B] x, g, beta, segment ids."""
    x, g, beta = (np.stack([s[i][n + t] for s, n in zip(seqs, prompts)]) for i in range(3))
    return jnp.asarray(x), jnp.asarray(g), jnp.asarray(beta), jnp.ones((len(seqs),), jnp.int32)


def test_uncached_packed_rows_reset_at_segment_starts():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((C, 1, SHAPE.conv_kernel)).astype(np.float32) * 0.5)
    a, b, c = _inputs(rng, 5), _inputs(rng, 1), _inputs(rng, 3)  # the third sequence reuses the first's id
    x, g, beta = (jnp.asarray(np.concatenate([a[i], b[i], c[i]])[None]) for i in range(3))
    seg = jnp.asarray([[1] * 5 + [2] + [1] * 3], jnp.int32)
    o, none = deltanet_mix(x, g, beta, seg, conv_weight=w, shape=SHAPE)
    assert none is None
    want = np.concatenate([reference(*a, w)[0], reference(*b, w)[0], reference(*c, w)[0]])
    np.testing.assert_allclose(np.asarray(o[0]), want, atol=1e-5, rtol=1e-5)
    # the check can fail: one segment over the whole row differs from the second segment on
    o1, _ = deltanet_mix(x, g, beta, jnp.ones_like(seg), conv_weight=w, shape=SHAPE)
    assert float(jnp.max(jnp.abs(o1[0, 5:] - o[0, 5:]))) > 1e-3


def test_bad_shapes_are_named():
    x = jnp.zeros((1, 2, C + 1))
    with pytest.raises(ValueError, match="mixed_qkv has shape"):
        deltanet_mix(x, jnp.zeros((1, 2, H)), jnp.zeros((1, 2, H)), jnp.ones((1, 2), jnp.int32),
                     conv_weight=jnp.zeros((C, 1, SHAPE.conv_kernel)), shape=SHAPE)
