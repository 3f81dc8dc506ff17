"""The decoder: one implementation for Llama 3.x, Qwen2/2.5, Qwen3, Mistral and the MoE families (Qwen3-MoE, Mixtral).

    tokens [B, T] -> embed [B, T, D] -> L x Block -> RMSNorm -> lm_head -> logits [B, T, V]
    Block:  h += Attention(RMSNorm(h));  h += MLP(RMSNorm(h))      (pre-norm, SwiGLU, GQA, rope)
            the MLP is the dense SwiGLU, or with `cfg.moe` the mixture of experts (layers/moe.py)

Families differ only by ModelConfig flags (attention bias, q/k norm, sliding window, rope scaling, tied
embeddings, the MoE section). The L blocks are stacked on a leading `layers` axis (every per-layer parameter is [L, ...]) and
run under `jax.lax.scan`, so compile time does not grow with depth and remat / host streaming / pipeline
stages act on one layer slice at a time. Training settings (remat policy, dtype policy, LoRA, sharding) are
passed in or applied from outside; none of them lives in ModelConfig.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from surojax.models.config import ModelConfig
from surojax.models.kv import Cache, KVCache
from surojax.models.layers.attention import Attention, layer_window_table
from surojax.models.layers.attention_backend import AttentionBackend
from surojax.models.layers.mlp import MLP
from surojax.models.layers.moe import MoE
from surojax.models.layers.norm import RMSNorm
from surojax.models.layers.params import AXES, param
from surojax.models.layers.rope import attention_factor, inv_freq, rope_cos_sin


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, attention: AttentionBackend | str, param_dtype,
                 rngs: nnx.Rngs | None = None):
        D = cfg.hidden_size
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps, "embed", param_dtype=param_dtype, rngs=rngs)
        self.attn = Attention(cfg, backend=attention, param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(D, cfg.rms_norm_eps, "embed", param_dtype=param_dtype, rngs=rngs)
        if cfg.moe is None:
            self.mlp = MLP(D, cfg.intermediate_size, param_dtype=param_dtype, rngs=rngs)
        else:
            self.mlp = MoE(D, cfg.moe, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, h, cos, sin, segment_ids, positions, kv=None, kv_meta=None, window=None):
        """-> (h, kv, router stats of a MoE layer or None). `window`: this layer's attention window (per-layer
        windows, scanned with the layer)."""
        a, kv = self.attn(self.attn_norm(h), cos, sin, segment_ids, positions, kv, kv_meta, window)
        h = h + a
        if isinstance(self.mlp, MoE):
            m, stats = self.mlp(self.mlp_norm(h), segment_ids)
            return h + m, kv, stats
        return h + self.mlp(self.mlp_norm(h)), kv, None


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, param_dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab, dim), ("vocab", "embed"), param_dtype)  # [V, D]


class LMHead(nnx.Module):
    def __init__(self, dim: int, vocab: int, *, param_dtype, rngs: nnx.Rngs):
        self.kernel = param(rngs, (dim, vocab), ("embed", "vocab"), param_dtype)  # [D, V]


def on_device(layer_state):
    """Copy the leaves of one layer's weights that live in host memory to the device (others pass through).

    The scan body calls it on its layer slice, so weights kept in host memory (offload_base_weights places the
    stacked base there) cross to the device one layer per scan step, in the forward pass and again wherever
    the backward pass recomputes the layer; XLA schedules the copy. The embedding gather calls it on the table.
    """
    def fetch(x):
        if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
            return jax.device_put(x, jax.memory.Space.Device)
        return x

    return jax.tree.map(fetch, layer_state)


def check_stacked(layer_state) -> None:
    """The scan over the layer stack slices every leaf of `layer_state` on its leading `layers` axis: every leaf
    must be [L, ...] with one L. A state that is not (a base held as per-layer host buffers, offload_prefetch's
    `HostLayers`: L arrays without the layers axis) needs a layer loop of its own (`remat.run_layers`)."""
    leading = {tuple(jnp.shape(x))[:1] for x in jax.tree.leaves(layer_state)}
    if len(leading) > 1:
        raise ValueError(f"the layer weights are not stacked on one leading layers axis (leading sizes "
                         f"{sorted(leading)}): the scan cannot run them. A base held as per-layer host buffers "
                         f"(offload_prefetch) is read by a layer loop of its own only "
                         f"(Decoder.hidden_states(layer_loop=<an object with run_layers>), no KV cache)")


def split_in_place(layer_state):
    """The leaves of the layer stack that read their own layer in place (`stacked_in_place`: a weight laid out
    for the decode kernel, surojax.quant.laid_out) are not sliced by the scan: XLA would copy each layer's slice
    out of the stack before the kernel's custom call (a weight-sized copy per layer and token). -> (xs, rebuild):
    xs = layer_state with those leaves removed (None), for the scan to slice; rebuild(xs_l, i) = layer i's state,
    those leaves given the whole stack and the index i. (layer_state, None) when there are none."""
    in_place = lambda x: getattr(x, "stacked_in_place", False)  # noqa: E731
    leaves, treedef = jax.tree.flatten(layer_state, is_leaf=in_place)
    whole = {i: leaf for i, leaf in enumerate(leaves) if in_place(leaf)}
    if not whole:
        return layer_state, None
    xs = [None if i in whole else leaf for i, leaf in enumerate(leaves)]

    def rebuild(xs_l, index):
        return treedef.unflatten([whole[i].at_layer(index) if i in whole else leaf for i, leaf in enumerate(xs_l)])

    return xs, rebuild


def _stack_blocks(make: Callable[[jax.Array], Block], keys: jax.Array) -> Block:
    """Build L blocks with one key each and stack every parameter on a new leading `layers` axis."""
    stacked = nnx.vmap(make, in_axes=0, out_axes=0)(keys)
    for _, var in nnx.iter_graph(stacked):
        if isinstance(var, nnx.Variable) and AXES in var.get_metadata():
            var.set_metadata(AXES, ("layers",) + tuple(var.get_metadata()[AXES]))
    return stacked


LAYER_INPUT = "layer_input"  # the checkpoint name of each layer's input (what `recompute: offload` moves to host)

class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 attention: AttentionBackend | str = "auto", rngs: nnx.Rngs):
        """dtype: activation/compute dtype; param_dtype: storage dtype of the weights; attention: the backend (its
        config spelling is parsed here: models/layers/attention_backend.py)."""
        self.cfg = cfg
        self.dtype = dtype
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = Embedding(V, D, param_dtype=param_dtype, rngs=rngs)
        keys = jax.random.split(rngs.params(), cfg.num_layers)
        self.layers = _stack_blocks(
            lambda k: Block(cfg, attention=attention, param_dtype=param_dtype, rngs=nnx.Rngs(params=k)), keys)
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, "embed", param_dtype=param_dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(D, V, param_dtype=param_dtype, rngs=rngs)

    # ---- forward ----------------------------------------------------------------------------------------
    def hidden_states(self, tokens, positions, segment_ids, *, cache: Cache | None = None,
                      layer_loop: Callable | None = None, unroll: int | bool = 1, cache_in_carry: bool = False,
                      router_stats: bool = False):
        """tokens/positions/segment_ids [B, T] -> (final-normed hidden [B, T, D], updated cache or None), and with
        `router_stats` a third element: the MoE layers' `RouterStats` stacked on [L] (None for a dense model).

        `layer_loop` (offload.remat.layer_loop makes it; None: the plain scan) either wraps the per-layer scan body
        (a recompute wrapper, e.g. `functools.partial(jax.checkpoint, policy=...)`), or, when it has a
        `run_layers(apply_layer, h, layer_state, consts, unroll=)` method, runs the whole layer stack in place of
        the scan (offload/prefetch.py: the streamed base fetched one layer ahead; training only).
        `unroll` is `lax.scan`'s: 1 = a rolled loop (one compiled layer), True = every layer inlined (no
        per-layer copies of the saved activations into stacked buffers; longer compile). Same math either way.
        `cache_in_carry` (with a cache; the serving runner's choice): the whole cache rides in the scan carry and
        each layer writes its new k/v into it in place (`cache.carried()`) instead of the cache being a scan
        input + output (`cache.per_layer()`: a copy of every layer's slice in and out per call). Same values
        either way. A cache with `carry_only` (`PagedKVCache`, the serving pool) always rides in the carry.
        Any `surojax.models.kv.Cache` works; attention hands it the call's metadata (`cache.step`).
        """
        h = jnp.take(on_device(self.embed.embedding[...]), tokens, axis=0).astype(self.dtype)  # [B, T, D]
        cos, sin = rope_cos_sin(positions, inv_freq(self.cfg), self.dtype, attention_factor(self.cfg))  # [B, T, H]
        kv_meta = None
        if cache is not None:
            kv_meta, cache = cache.step(segment_ids, positions)
            cache_in_carry = cache_in_carry or cache.carry_only

        graphdef, layer_state = nnx.split(self.layers)
        windows = layer_window_table(self.cfg)  # [L] int32 per-layer attention windows, scanned; None: static
        windows = None if windows is None else jnp.asarray(windows)
        run_layers = getattr(layer_loop, "run_layers", None)  # a layer loop of its own (offload/prefetch.py)
        if run_layers is not None and cache is None:
            if router_stats and self.cfg.moe is not None:
                raise ValueError("router statistics are not collected by a layer loop of its own (offload_prefetch)")
            if windows is not None:
                raise ValueError("per-layer attention windows (layer_types) are not supported by a layer loop of "
                                 "its own (offload prefetch); use the scanned layers")

            def apply_layer(state_l, h, consts):
                return nnx.merge(graphdef, state_l)(h, *consts)[0]

            h = run_layers(apply_layer, h, layer_state, (cos, sin, segment_ids, positions), unroll=unroll)
            return (self.final_norm(h), None) + ((None,) if router_stats else ())

        layer_xs, rebuild = split_in_place(layer_state)
        check_stacked(layer_xs)  # what the scan slices (a weight read in place may hold stacks of other lengths)
        layer_ids = None if rebuild is None else jnp.arange(self.cfg.num_layers)

        def layer_block(xs_l, index):
            return nnx.merge(graphdef, on_device(xs_l if rebuild is None else rebuild(xs_l, index)))

        def body(h, xs):
            (state_l, index), kv_l, window_l = xs
            h = checkpoint_name(h, LAYER_INPUT)  # the residual that `recompute: offload` keeps in host memory
            block = layer_block(state_l, index)
            h, kv_l, stats = block(h, cos, sin, segment_ids, positions, kv_l, kv_meta, window_l)
            return h, (kv_l, stats)

        def carry_body(carry, xs):
            (h, kv), ((state_l, index), window_l) = carry, xs
            block = layer_block(state_l, index)
            h, kv, stats = block(h, cos, sin, segment_ids, positions, kv, kv_meta, window_l)
            return (h, dataclasses.replace(kv, layer=kv.layer + 1)), stats

        layer_xs = (layer_xs, layer_ids)
        if cache is not None and cache_in_carry:
            loop_body = carry_body if layer_loop is None else layer_loop(carry_body)
            (h, kv), stats = jax.lax.scan(loop_body, (h, cache.carried()), (layer_xs, windows), unroll=unroll)
            out = (self.final_norm(h), cache.with_kv(kv.k, kv.v))
            return out + ((stats,) if router_stats else ())
        if layer_loop is not None:
            body = layer_loop(body)
        h, (new_kv, stats) = jax.lax.scan(body, h, (layer_xs, None if cache is None else cache.per_layer(), windows),
                                          unroll=unroll)
        if cache is not None:
            cache = cache.with_kv(new_kv.k, new_kv.v)
        return (self.final_norm(h), cache) + ((stats,) if router_stats else ())

    def head_weight(self) -> jax.Array:
        """The output projection as [D, V] (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, h: jax.Array) -> jax.Array:
        """h [B, T, D] -> logits [B, T, V] in fp32 (accumulated in fp32 from compute-dtype operands)."""
        w = self.head_weight().astype(h.dtype)
        return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions=None, segment_ids=None, *, cache: KVCache | None = None):
        """Logits [B, T, V] (and the cache when one is given). Defaults: one segment, positions 0..T-1."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens, dtype=jnp.int32)
        h, cache = self.hidden_states(tokens, positions, segment_ids, cache=cache)
        logits = self.logits(h)
        return (logits, cache) if cache is not None else logits
