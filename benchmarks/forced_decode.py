"""Teacher-forced decode: K one-token steps over the serving pool with the tokens GIVEN (no sampled token fed
back), through any of the runner's KV paths, returning the fp32 logits of every step and the pool afterwards.

For checking a decode path against another: every path sees the same input tokens at every step, so a rounding
difference stays a rounding difference (it cannot flip a sampled token and change every later input).

    tokens [R, K] (token fed at position start + i), start [R] (tokens already in the pool),
    block_table [R, NB] (NB * block_size >= max(start) + K), pools k/v [L, N, K, H]
    -> (k_pool, v_pool, logits [R, K, V] fp32)

paths: "reference" (the dense-view path of ``reference_multi_step_decode`` with ``kv_in_place``: gather the rows'
context into a [L, R, S, K, H] view, decode over it, scatter the K new k/v back) or a ``PagedKernel`` value
("gather", "reduce", "pallas": the path of ``multi_step_decode_paged``). The same model code as the runner's
jitted calls; only the sampling and stopping around it is left out. The pools are not donated (the caller
compares several paths from one pool).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.kv import KVCache, PagedKernel, PagedKVCache, PagedLayerKV
from surojax.models.layers.rope import inv_freq, rope_cos_sin
from surojax.models.layer_runner import LayerScan

FORCED_PATHS = ("reference", "gather", "reduce", "pallas")


def pool_slots(block_table, positions, block_size: int):
    """block_table [R, NB], positions [R, T] -> pool slots [R, T] of those token positions."""
    block = jnp.take_along_axis(block_table, positions // block_size, axis=1)
    return block * block_size + positions % block_size


@functools.partial(jax.jit, static_argnames=("graphdef", "path", "block_size", "unroll"))
def forced_decode(graphdef, state, k_pool, v_pool, tokens, start, block_table, *, path: str, block_size: int,
                  unroll: int | bool = 1):
    """See the module docstring."""
    if path not in FORCED_PATHS:
        raise ValueError(f"forced_decode: path must be one of {', '.join(FORCED_PATHS)}, got {path!r}")
    model = nnx.merge(graphdef, state)
    R, K = tokens.shape
    NB = block_table.shape[1]
    S = NB * block_size
    block_table = block_table.astype(jnp.int32)
    start = start.astype(jnp.int32)
    ones = jnp.ones((R, 1), jnp.int32)
    if path == "reference":
        j = jnp.arange(S, dtype=jnp.int32)[None, :]
        ctx_slots = pool_slots(block_table, jnp.broadcast_to(j, (R, S)), block_size)  # [R, S]
        valid = j < start[:, None]
        cache = KVCache(k=k_pool[:, ctx_slots], v=v_pool[:, ctx_slots], segment_ids=valid.astype(jnp.int32),
                        positions=jnp.where(valid, j, 0).astype(jnp.int32), lengths=start)
    else:
        cache = PagedKVCache(k_pool, v_pool, block_table, start, block_size, PagedKernel(path))

    def step(cache, xs):
        i, tok = xs
        pos = (start + i)[:, None]
        h, cache, _ = model.hidden_states(tok[:, None], pos, ones, cache=cache,
                                          runner=LayerScan(unroll=unroll, carry_cache=path == "reference"))
        return cache, model.logits(h)[:, 0]  # [R, V] fp32

    cache, logits = jax.lax.scan(step, cache, (jnp.arange(K, dtype=jnp.int32), tokens.T))
    if path == "reference":
        view = start[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]  # [R, K] view slots = positions
        write = pool_slots(block_table, view, block_size)
        idx = jnp.arange(R)[:, None]
        k_pool = k_pool.at[:, write].set(cache.k[:, idx, view].astype(k_pool.dtype))
        v_pool = v_pool.at[:, write].set(cache.v[:, idx, view].astype(v_pool.dtype))
        return k_pool, v_pool, jnp.swapaxes(logits, 0, 1)
    return cache.k, cache.v, jnp.swapaxes(logits, 0, 1)


@functools.partial(jax.jit, static_argnames=("graphdef", "kernel", "block_size"))
def forced_attention(graphdef, state, x, k_pool, v_pool, block_table, lengths, layer, *, kernel: str,
                     block_size: int):
    """One layer's attention sublayer alone, through the paged pool: the layer's ``Attention`` module (its
    ``PagedLayerKV``, read by the `PagedKernel` named "gather", "reduce" or "pallas") on x [R, 1, D] as one new
    token per row at
    position lengths [R] (written to the pool first, then attended with the row's context).
    layer: int32 scalar. -> y [R, 1, D] fp32 (after o_proj). Isolates the attention: the check of a kernel
    without the rest of the network's rounding on top."""
    model = nnx.merge(graphdef, state)
    layers_def, layers_state = nnx.split(model.layers)
    block = nnx.merge(layers_def, jax.tree.map(lambda a: a[layer], layers_state))
    R = x.shape[0]
    seg = jnp.ones((R, 1), jnp.int32)
    pos = lengths.astype(jnp.int32)[:, None]
    kernel = PagedKernel(kernel)
    cache = PagedKVCache(k_pool, v_pool, block_table.astype(jnp.int32), lengths.astype(jnp.int32), block_size, kernel)
    kv_meta, _ = cache.step(seg, pos)
    cos, sin = rope_cos_sin(pos, inv_freq(model.cfg), x.dtype)
    kv = PagedLayerKV(k_pool, v_pool, jnp.asarray(layer, jnp.int32), block_size, kernel)
    y, _ = block.attn(x, cos, sin, seg, pos, kv, kv_meta)
    return y.astype(jnp.float32)


__all__ = ["FORCED_PATHS", "forced_attention", "forced_decode", "pool_slots"]
