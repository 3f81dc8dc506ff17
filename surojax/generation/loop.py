"""Batched generation with a plain KV cache: training's generation eval, `surojax generate`, checks and demos
(the serving engine pages its cache). A hybrid model (a `linear_layers` stack of Gated DeltaNet layers, or LFM2's
`conv_layers` of short convolutions, beside the attention `layers`) gets a `HybridCache`: the KV cache over its
attention layers, each other layer's fixed-size state (conv window [+ recurrent], zeros at the start)
(`empty_cache`; models/kv/recurrent.py).

    prefill(prompts)  -> cache, logits of each row's last prompt token
    decode_one_token  -> one new token per row, appended to the cache
    generate          -> prefill, then decode until max_new_tokens or every row has hit a stop id

Prompts of different lengths are right-padded; padding has segment id 0, so it is never attended, the next
decoded token overwrites its cache slot, and it leaves the linear layers' states unchanged. Greedy results do not
depend on the batch they run in.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.generation.sampling import sample
from surojax.models.decoder import Decoder, state_shape
from surojax.models.kv import ATTENTION_STACK, Cache, HybridCache, KVCache, StacksKVCache, state_stack
from surojax.models.registry import GLOBAL_STACK
from surojax.models.vision.inputs import prepare_images


def empty_cache(model: Decoder, batch: int, max_len: int, dtype) -> Cache:
    """A fresh cache for `batch` sequences of up to `max_len` tokens: a `KVCache` over the model's layers, or for
    a hybrid model (its layer pattern reads a `linear_layers` or LFM2's `conv_layers` stack) a `HybridCache`: the KV
    cache over the attention stack's rows and zero states over the state stack's rows, sized by
    `decoder.state_shape(model.cfg)`. Gemma 4 with full layers of their own shape: a `StacksKVCache` (a KV cache
    for `layers` and one for `global_layers`)."""
    pattern = model.layer_pattern
    stack = state_stack(pattern.caches)
    if GLOBAL_STACK in pattern.caches:  # Gemma 4's full layers of their own shape: a KV cache of theirs
        cfg = model.cfg
        return StacksKVCache.empty({ATTENTION_STACK: (cfg, pattern.cache_rows(ATTENTION_STACK)),
                                    GLOBAL_STACK: (cfg.global_config(), pattern.cache_rows(GLOBAL_STACK))},
                                   batch, max_len, dtype)
    if stack is None:
        return KVCache.empty(model.cfg, batch, max_len, dtype)
    kv = KVCache.empty(model.cfg, batch, max_len, dtype, num_layers=pattern.cache_rows(ATTENTION_STACK))
    return HybridCache.empty(kv, pattern.cache_rows(stack), state_shape(model.cfg), dtype, state_stack=stack)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(graphdef, state, tokens, segment_ids, cache, images=None, rope_positions=None):
    model = nnx.merge(graphdef, state)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    vision = {} if images is None and rope_positions is None else {"images": images, "rope_positions": rope_positions}
    logits, cache = model(tokens, positions, segment_ids, cache=cache, **vision)  # a text model takes no image keys
    last = jnp.sum(segment_ids > 0, axis=1) - 1  # [B]
    return logits[jnp.arange(B), last], cache  # [B, V]


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "top_p", "min_p"))
def _decode_one_token(graphdef, state, token, cache, key, temperature, top_k, top_p, min_p, rope_deltas=None):
    model = nnx.merge(graphdef, state)
    positions = cache.lengths[:, None]  # [B, 1]: the next position of each row
    rope = None  # after an image prompt: M-RoPE positions = position + delta on all three axes
    if rope_deltas is not None:
        rope = jnp.broadcast_to((positions + rope_deltas[:, None])[None], (3, *positions.shape))
    vision = {} if rope is None else {"rope_positions": rope}
    logits, cache = model(token[:, None], positions, jnp.ones_like(token)[:, None], cache=cache, **vision)
    return sample(logits[:, 0], key, temperature, top_k, top_p, min_p), cache


def generate(model: Decoder, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
             stop_ids: tuple[int, ...] = (), cache_dtype=None, pixel_values=None,
             image_grid_thw=None) -> list[list[int]]:
    """New token ids for each prompt (a row stops after its first stop id, which is kept). A vision-language
    model: pixel_values / image_grid_thw, one entry per prompt ([P, patch_dim] / [n, 3], None for a text row),
    the images of the prompt's expanded image tokens (`models.vision.inputs.prepare_images`): the tower runs in
    the prefill, the prompt takes M-RoPE positions and each generated token index + rope_delta on all axes."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    B, T = len(prompts), max(len(p) for p in prompts)
    tokens = np.zeros((B, T), np.int32)
    segments = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
        segments[i, :len(p)] = 1
    graphdef, state = nnx.split(model)
    cache = empty_cache(model, B, T + max_new_tokens, cache_dtype or model.dtype)
    images = rope = deltas = None
    if pixel_values is not None:
        batch = prepare_images(model.cfg, tokens, list(pixel_values), list(image_grid_thw), segment_ids=segments)
        images, rope, deltas = batch.images, jnp.asarray(batch.rope_positions), jnp.asarray(batch.rope_deltas)
    logits, cache = _prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(segments), cache, images, rope)
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    token = sample(logits, sub, temperature, top_k, top_p, min_p)
    out = [token]
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
    done = jnp.isin(token, stops)
    for _ in range(max_new_tokens - 1):
        if stop_ids and bool(done.all()):  # one host sync a step, only when stops are asked for
            break
        key, sub = jax.random.split(key)
        token, cache = _decode_one_token(graphdef, state, token, cache, sub, temperature, top_k, top_p, min_p,
                                         deltas)
        done = done | jnp.isin(token, stops)
        out.append(token)
    ids = np.asarray(jnp.stack(out, axis=1))  # [B, max_new_tokens]
    results = []
    for row in ids.tolist():
        for j, t in enumerate(row):
            if t in stop_ids:
                row = row[:j + 1]
                break
        results.append(row)
    return results


def eos_ids(model_dir: Path | None, tokenizer, cfg) -> tuple[int, ...]:
    """The ids that end a completion: the config's, the tokenizer's and generation_config.json's eos ids."""
    ids: set[int] = set()
    sources = [cfg.eos_token_id, tokenizer.eos_token_id]
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        sources.append(json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id"))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(x) for x in s)
    return tuple(sorted(ids))
