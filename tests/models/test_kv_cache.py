"""The KV caches behind one protocol (surojax/models/kv): each cache's layer view writes the new tokens' k/v where
its metadata says and attends over the row's context exactly as a dense masked attention written out here
(the independent reference: the context assembled by hand in numpy, softmax in numpy)."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.models.kv import AttendSpec, KVCache, PagedKernel, PagedKVCache, PagedLayerKV
from surojax.models.layers.attention import xla_attention

B, T, N, K, H, L, BS, NB = 2, 3, 4, 2, 8, 2, 4, 4  # NB blocks per row: S = 16 context slots
LENGTHS = np.array([5, 9])  # tokens already cached per row


def _reference(q, ctx_k, ctx_v, lengths, T):
    """q [B, T, N, H]; ctx k/v [B, S, K, H] holding the cached AND new tokens at positions 0 .. lengths + T - 1.
    New token t of row b (position lengths[b] + t) attends to positions <= its own."""
    out = np.zeros(q.shape, np.float64)
    G = N // K
    for b in range(B):
        for t in range(T):
            keep = lengths[b] + t + 1
            for n in range(N):
                s = ctx_k[b, :keep, n // G] @ q[b, t, n] * H ** -0.5
                p = np.exp(s - s.max())
                out[b, t, n] = (p / p.sum()) @ ctx_v[b, :keep, n // G]
    return out


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    S = NB * BS
    ctx_k, ctx_v = (rng.standard_normal((L, B, S, K, H)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
    positions = (LENGTHS[:, None] + np.arange(T)).astype(np.int32)
    return ctx_k, ctx_v, q, new_k, new_v, positions


def _expected(case, layer):
    ctx_k, ctx_v, q, new_k, new_v, _ = case
    k, v = ctx_k[layer].copy(), ctx_v[layer].copy()
    for b in range(B):
        k[b, LENGTHS[b]:LENGTHS[b] + T], v[b, LENGTHS[b]:LENGTHS[b] + T] = new_k[b], new_v[b]
    return _reference(q, k, v, LENGTHS, T), k, v


SPEC = AttendSpec(xla_attention, H ** -0.5)


@pytest.mark.parametrize("carried", [False, True])
def test_plain_cache_views_attend_like_the_reference(case, carried):
    ctx_k, ctx_v, q, new_k, new_v, positions = case
    S = NB * BS
    filled = (np.arange(S)[None, :] < LENGTHS[:, None]).astype(np.int32)
    cache = KVCache(jnp.asarray(ctx_k), jnp.asarray(ctx_v), jnp.asarray(filled),
                    jnp.asarray(np.where(filled, np.arange(S), 0), jnp.int32), jnp.asarray(LENGTHS, jnp.int32))
    meta, cache = cache.step(jnp.ones((B, T), jnp.int32), jnp.asarray(positions))
    assert list(np.asarray(cache.lengths)) == list(LENGTHS + T)
    layer = 1
    if carried:
        view = cache.carried()
        view = type(view)(view.k, view.v, jnp.int32(layer))
        out, view = view.update_and_attend(jnp.asarray(q), jnp.asarray(new_k), jnp.asarray(new_v), meta, SPEC)
        got_k, got_v = view.k[layer], view.v[layer]
    else:
        view = jax.tree.map(lambda a: a[layer], cache.per_layer())
        out, view = view.update_and_attend(jnp.asarray(q), jnp.asarray(new_k), jnp.asarray(new_v), meta, SPEC)
        got_k, got_v = view.k, view.v
    want, k, v = _expected(case, layer)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_k), k)
    np.testing.assert_array_equal(np.asarray(got_v), v)


@pytest.mark.parametrize("kernel, T_", [(PagedKernel.GATHER, T), (PagedKernel.REDUCE, 1), (PagedKernel.PALLAS, 1)])
def test_paged_pool_attends_like_the_reference(case, kernel, T_):
    """The same rows held in a paged pool (blocks scattered by a permuted table): every kernel writes the new
    tokens into the right pool slots and attends as the reference (REDUCE / PALLAS serve one-token rows)."""
    ctx_k, ctx_v, q, new_k, new_v, positions = case
    q, new_k, new_v, positions = q[:, :T_], new_k[:, :T_], new_v[:, :T_], positions[:, :T_]
    num_blocks = 2 * B * NB
    table = np.random.default_rng(1).permutation(num_blocks)[:B * NB].reshape(B, NB).astype(np.int32)
    slots = (table[:, :, None] * BS + np.arange(BS)).reshape(B, NB * BS)  # [B, S] pool slot of each position
    pool_k = np.zeros((L, num_blocks * BS, K, H), np.float32)
    pool_v = np.zeros_like(pool_k)
    for b in range(B):
        pool_k[:, slots[b]], pool_v[:, slots[b]] = ctx_k[:, b], ctx_v[:, b]
    cache = PagedKVCache(jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table), jnp.asarray(LENGTHS, jnp.int32),
                         BS, kernel)
    meta, cache = cache.step(jnp.ones((B, T_), jnp.int32), jnp.asarray(positions))
    view = cache.carried()
    layer = 1
    view = type(view)(view.k, view.v, jnp.int32(layer), BS, kernel)
    out, view = view.update_and_attend(jnp.asarray(q), jnp.asarray(new_k), jnp.asarray(new_v), meta, SPEC)
    k, v = ctx_k[layer].copy(), ctx_v[layer].copy()
    for b in range(B):
        k[b, LENGTHS[b]:LENGTHS[b] + T_], v[b, LENGTHS[b]:LENGTHS[b] + T_] = new_k[b], new_v[b]
    want = _reference(q, k, v, LENGTHS, T_)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)
    for b in range(B):
        np.testing.assert_array_equal(np.asarray(view.k[layer])[slots[b]], k[b])
        np.testing.assert_array_equal(np.asarray(view.v[layer])[slots[b]], v[b])
    np.testing.assert_array_equal(np.asarray(view.k[0]), pool_k[0])  # another layer: untouched


@pytest.mark.parametrize("window", [None, 2])
def test_fresh_paged_call_attends_over_its_own_tokens(window):
    """A fresh call (`PagedKVCache.fresh`: no row has cached tokens) reads nothing back from the pool: it writes
    the new k/v exactly where the gather path does and its real tokens' outputs equal the gather path's and a
    numpy causal attention over the call's own tokens (row 1 padded: only its first 2 tokens are real)."""
    rng = np.random.default_rng(2)
    T_ = 4
    q = rng.standard_normal((B, T_, N, H)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((B, T_, K, H)).astype(np.float32) for _ in range(2))
    segments = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)
    positions = np.broadcast_to(np.arange(T_, dtype=np.int32), (B, T_))
    num_blocks = 2 * B * NB
    table = rng.permutation(num_blocks)[:B * NB].reshape(B, NB).astype(np.int32)
    pool = rng.standard_normal((L, num_blocks * BS, K, H)).astype(np.float32)  # stale values in every slot
    spec = AttendSpec(xla_attention, H ** -0.5, window)
    outs, views = [], []
    for fresh in (False, True):
        cache = PagedKVCache(jnp.asarray(pool), jnp.asarray(pool), jnp.asarray(table), jnp.zeros(B, jnp.int32), BS,
                             PagedKernel.GATHER, fresh=fresh)
        meta, cache = cache.step(jnp.asarray(segments), jnp.asarray(positions))
        view = cache.carried()
        out, view = view.update_and_attend(jnp.asarray(q), jnp.asarray(new_k), jnp.asarray(new_v), meta, spec)
        outs.append(np.asarray(out))
        views.append(view)
    real = segments.astype(bool)
    np.testing.assert_allclose(outs[1][real], outs[0][real], atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(views[1].k), np.asarray(views[0].k))
    np.testing.assert_array_equal(np.asarray(views[1].v), np.asarray(views[0].v))
    G = N // K
    for b in range(B):
        for t in range(int(segments[b].sum())):
            lo = 0 if window is None else max(0, t - window + 1)
            for n in range(N):
                s = new_k[b, lo:t + 1, n // G] @ q[b, t, n] * H ** -0.5
                p = np.exp(s - s.max())
                np.testing.assert_allclose(outs[1][b, t, n], (p / p.sum()) @ new_v[b, lo:t + 1, n // G],
                                           atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fresh, new_tokens", [(False, 3), (True, 2 * BS)])
def test_paged_kv_write_promises_distinct_slots_and_reads_nothing_from_the_pool(fresh, new_tokens):
    """`PagedLayerKV.write` touches the pool only as the operand of scatters that promise unique indices, on the
    token path and the fresh block-by-block path: XLA's GPU scatter without the promise writes every element by an
    atomic read-modify-write (4.6 ms of a 26 ms 16 x 512 prefill call on an H100), and a fresh write that read its
    partial block back from the pool made XLA copy the whole pool once per layer (73 ms a call; RESULTS.md s27)."""
    pool = jnp.zeros((L, 8 * BS, K, H))
    x = jnp.zeros((B, new_tokens, K, H))

    def write(pk, pv, k, v, slots):
        view = PagedLayerKV(pk, pv, jnp.int32(1), BS, PagedKernel.GATHER, None, fresh, None)
        out = view.write(k, v, slots)
        return out.k, out.v

    jaxpr = jax.make_jaxpr(write)(pool, pool, x, x, jnp.zeros((B, new_tokens), jnp.int32)).jaxpr
    pools, scatters = set(jaxpr.invars[:2]), 0
    for eqn in jaxpr.eqns:
        reads = [i for i, v in enumerate(eqn.invars) if not isinstance(v, jax.extend.core.Literal) and v in pools]
        if eqn.primitive.name == "reshape" and reads:
            pools.update(eqn.outvars)
        elif eqn.primitive.name == "scatter" and reads:
            assert reads == [0], f"the pool fed a scatter's indices or updates: {eqn}"
            assert eqn.params["unique_indices"], f"a KV write without unique_indices: {eqn}"
            pools.update(eqn.outvars)
            scatters += 1
        else:
            assert not reads, f"the pool was read by {eqn.primitive.name}: {eqn}"
    assert scatters == (4 if fresh else 2) and set(jaxpr.outvars) <= pools
