"""Activation recomputation policies for the scanned decoder layer (`recompute:` in the config).

    none   keep every activation of every layer (fastest, most memory)
    full   keep only each layer's input; recompute the layer in the backward pass
    dots   keep the outputs of matmuls without batch dimensions (projections), recompute the rest
    offload  (not available yet) keep each layer's input in host memory
The result wraps the scan body of `Decoder.hidden_states`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

POLICIES = ("none", "full", "dots", "offload")


def remat_wrapper(name: str) -> Callable | None:
    if name == "none":
        return None
    if name == "full":
        return functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    if name == "dots":
        return functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if name == "offload":
        raise NotImplementedError("recompute: offload (activations in host memory) is not available yet; "
                                  "use full or dots")
    raise ValueError(f"recompute {name!r} is unknown ({', '.join(POLICIES)})")
