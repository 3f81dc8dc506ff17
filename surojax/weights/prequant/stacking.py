"""One parameter of the Decoder from its per-layer (and per-expert) quantised weights: the format pytrees stacked
along the state's leading axes, as `surojax.quant.transform.quantize_stacked` leaves a quantised kernel (leaves
[L, ...] or [L, E, ...]), so the layer scan, LoRA and serving treat a loaded pre-quantised base exactly like one
quantised at load (`qlora:`).

    value, why = stack_quantized(parts, lead)   # parts: {(layer,) or (layer, expert): {half: QuantFormat}}

A MoE layer's gate and up projections fill one gate_up kernel ([K, 2F]: gate | up along N). `join_columns` joins
two quantised [K, F] weights along N where the format can hold the result exactly (FP8 blocks that do not straddle
the seam, NVFP4 with one global scale, NF4 without double quantisation: their arrays are row-wise and
concatenate); otherwise it returns None and the caller dequantises that parameter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from surojax.quant.base import QuantFormat
from surojax.quant.fp8 import FP8Block
from surojax.quant.nf4 import NF4
from surojax.quant.nvfp4 import NVFP4


def join_columns(a: QuantFormat, b: QuantFormat) -> QuantFormat | None:
    """[K, Na] and [K, Nb] -> [K, Na + Nb] in the same format, or None when the format cannot hold it exactly."""
    if type(a) is not type(b) or a.shape[0] != b.shape[0]:
        return None
    (k, na), nb = a.shape, b.shape[1]
    cat = lambda x, y: np.concatenate([np.asarray(x), np.asarray(y)], axis=0)  # noqa: E731  the N rows
    if isinstance(a, FP8Block) and a.block == b.block and na % a.block[0] == 0:
        return dataclasses.replace(a, data=cat(a.data, b.data), scale=cat(a.scale, b.scale), shape=(k, na + nb))
    if isinstance(a, NVFP4) and np.array_equal(np.asarray(a.global_scale), np.asarray(b.global_scale)):
        return dataclasses.replace(a, data=cat(a.data, b.data), scale=cat(a.scale, b.scale), shape=(k, na + nb))
    if isinstance(a, NF4) and not a.double_quant and not b.double_quant:
        return dataclasses.replace(a, data=cat(a.data, b.data), absmax=cat(a.absmax, b.absmax), shape=(k, na + nb))
    return None


def stack_quantized(parts: dict[tuple[int, ...], dict[int | None, QuantFormat]],
                    lead: tuple[int, ...]) -> tuple[QuantFormat | None, str]:
    """parts: for each leading index (() for an unstacked parameter, (layer,), (layer, expert)) its weight (key None)
    or its two halves along N (keys 0, 1). -> (the stacked pytree with leading axes `lead`, "") or (None, why)."""
    weights = []
    for index in sorted(parts):
        halves = parts[index]
        if None in halves:
            weights.append(halves[None])
            continue
        joined = join_columns(halves[0], halves[1])
        if joined is None:
            return None, f"the two halves of {index} cannot be joined in {halves[0].name} exactly"
        weights.append(joined)
    if len({jax.tree.structure(w) for w in weights}) > 1 or len({
            tuple(np.shape(x) for x in jax.tree.leaves(w)) for w in weights}) > 1:
        layouts = ", ".join(sorted({repr(w) for w in weights}))
        return None, f"its layers are stored in different layouts ({layouts})"
    if not lead:
        return jax.tree.map(jnp.asarray, weights[0]), ""
    return jax.tree.map(lambda *xs: jnp.asarray(np.stack([np.asarray(x) for x in xs]).reshape(*lead, *np.shape(xs[0]))),
                        *weights), ""
