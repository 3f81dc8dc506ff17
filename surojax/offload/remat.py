"""Activation recomputation policies for the scanned decoder layer (`recompute:` in the config).

    none     keep every activation of every layer (fastest, most memory)
    full     keep only each layer's input; recompute the layer in the backward pass
    dots     keep the outputs of matmuls without batch dimensions (projections), recompute the rest
    offload  as full, but each layer's input (the `layer_input` name the decoder's scan body gives it) is kept
             in host memory (`pinned_host`) and copied back for the backward pass: device memory for saved
             activations is O(1) in depth, host memory holds L x B x T x D
The result wraps the scan body of `Decoder.hidden_states`. With `offload_base_weights` the streamed weights are
never saved by full / dots / offload (they are recomputed by fetching the layer again); `none` is refused.
`layer_loop(recompute, prefetch=True)` (offload_prefetch) gives the prefetching layer loop instead (prefetch.py),
which implements `full` itself.

On the CPU backend `offload` runs the same program (the host residuals are real `pinned_host` values in the
jaxpr; the copies lower to no-ops), so its results equal `full` exactly.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

from surojax.offload.prefetch import PrefetchedLayers
from surojax.models.decoder import LAYER_INPUT  # the checkpoint name the decoder gives each layer's input

POLICIES = ("none", "full", "dots", "offload")


def remat_wrapper(name: str) -> Callable | None:
    if name == "none":
        return None
    if name == "full":
        return functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    if name == "dots":
        return functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if name == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
            offload_src="device", offload_dst="pinned_host")
        return functools.partial(jax.checkpoint, policy=policy)
    raise ValueError(f"recompute {name!r} is unknown ({', '.join(POLICIES)})")


def layer_loop(recompute: str, *, prefetch: bool = False, per_layer: bool = False):
    """What the trainer passes as the decoder's `layer_loop=`: the recompute wrapper of the scan body, or with `prefetch`
    (offload_prefetch; recompute must be full) the double-buffered streamed layer loop (`per_layer`: always its
    unrolled per-layer form, which a `HostLayers` base gets anyway; the bench's resident twin)."""
    if not prefetch:
        return remat_wrapper(recompute)
    if recompute != "full":
        raise ValueError(f"offload_prefetch recomputes each layer whole: recompute must be full, not {recompute!r}")

    return PrefetchedLayers(per_layer=per_layer)
