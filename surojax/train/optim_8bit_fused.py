"""adamw_8bit's update of the stacked layers as one fused pass per parameter (`optimizer_layerwise` on a GPU).

    FusedAdam8bit(...).update_layers(grad_sums, grad, denom, grad_norm, params, state) -> (params, state)
        grad_sums / params  the `layers` subtree, every leaf [L, ...]; state: adamw_8bit's chain state of the layers,
                            every leaf stacked [L, ...] (what `layerwise(adamw_8bit)` keeps)

The per-layer in-place loop (surojax/offload/optimizer.py `in_place`) runs the optax chain one layer at a time: XLA
then reads and writes each layer's gradient, parameter and moments in ~8 passes and copies each slice out of the
stacked arrays (several times the time its bytes need on the Qwen3-8B step: benchmarks/RESULTS.md#s13). Here every
[L, ...] leaf whose 8-bit state is in whole 256-value blocks per layer goes through pallas_kernels/adam8bit in ONE
kernel over all layers, written in place over the donated parameter and state buffers; every other leaf (fp32
moments: the small norms; a layer size that is not a multiple of the block) runs `adam_leaf`, the XLA form, one
layer at a time under lax.map.

The same update, operation for operation, as `in_place` with the chain (tests/train/test_optim_8bit_fused.py: bit
for bit on CPU, in interpret mode): the gradient divided and clipped, scale_by_adam_8bit (`adam_leaf`),
add_decayed_weights on the masked leaves (skipped at weight_decay 0, as optax does), scale_by_learning_rate
(-schedule(count)), apply_updates. Counts advance as the chain's would.

`SUROJAX_ADAM8BIT` (read when the step is traced): `auto` (the kernel on a GPU; off it the per-layer loop),
`kernel` (also off the GPU, in interpret mode: tests), `xla` (the per-layer loop: A/B runs).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallas_kernels.adam8bit import BLOCK, Adam8bitHyper, Adam8bitTiles, adam8bit_kernel
from surojax.train.optim_8bit import (SIGNED_MAP, UNSIGNED_MAP, Blockwise8bit, ScaleByAdam8bitState, _bucket_table,
                                      adam_leaf)

MODES = ("auto", "kernel", "xla")
TILES = Adam8bitTiles()


def mode() -> str:
    m = os.environ.get("SUROJAX_ADAM8BIT", "auto")
    if m not in MODES:
        raise ValueError(f"SUROJAX_ADAM8BIT={m!r}: expected one of {', '.join(MODES)}")
    return m


def _tables():
    s_first, s_bounds = _bucket_table(np.asarray(SIGNED_MAP, np.float32).tobytes())
    u_first, u_bounds = _bucket_table(np.asarray(UNSIGNED_MAP, np.float32).tobytes())
    return tuple(jnp.asarray(t) for t in (SIGNED_MAP, UNSIGNED_MAP, s_first, s_bounds, u_first, u_bounds))


@dataclasses.dataclass(frozen=True)
class FusedAdam8bit:
    """What the fused update needs of `adamw_8bit(schedule, b1, b2, eps, weight_decay, mask)` (train/optim.py
    builds both from the same arguments)."""
    learning_rate: Any  # an optax schedule (callable) or a float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    mask: Callable | None = None
    block_size: int = BLOCK

    def active(self) -> bool:
        """Whether the step uses it (SUROJAX_ADAM8BIT, the backend)."""
        m = mode()
        return m == "kernel" or (m == "auto" and jax.default_backend() == "gpu")

    def update_layers(self, grad_sums, grad: Callable, denom, grad_norm, max_norm: float | None, params, state):
        """(new params, new chain state) of the stacked layers. `grad(g_sum)`: the divided, clipped gradient of one
        leaf (in_place's), for the leaves the kernel does not take; the kernel computes the same from denom,
        grad_norm and max_norm."""
        adam, decay_state, lr_state = state
        if not isinstance(adam, ScaleByAdam8bitState):
            raise TypeError(f"fused 8-bit AdamW: expected adamw_8bit's chain state, got {type(adam).__name__}")
        count = optax.safe_increment(adam.count)  # [L]
        scheduled = isinstance(lr_state, optax.ScaleByScheduleState)

        def layer_scalars(xs):  # per layer, as scalars: the per-layer loop's arithmetic (a vectorised pow may round
            n, lr_count = xs    # otherwise on CPU)
            c1 = 1.0 - self.b1 ** n.astype(jnp.float32)
            c2 = 1.0 - self.b2 ** n.astype(jnp.float32)
            lr = self.learning_rate(lr_count) if scheduled else self.learning_rate
            return c1, c2, jnp.asarray(-lr, jnp.float32)

        c1, c2, step = jax.lax.map(layer_scalars, (count, lr_state.count if scheduled else count))
        if scheduled:
            lr_state = optax.ScaleByScheduleState(count=optax.safe_increment(lr_state.count))
        decayed = self.mask(params) if self.mask is not None and self.weight_decay else None
        scalars = jnp.stack([c1, c2, step, jnp.zeros_like(c1)], axis=1)  # [L, 4]
        glob = jnp.stack([jnp.asarray(denom, jnp.float32), jnp.asarray(grad_norm, jnp.float32)])
        use_kernel = self.active()
        tables = _tables() if use_kernel else None
        hyper = Adam8bitHyper(self.b1, self.b2, self.eps, float(self.weight_decay), max_norm or None)

        is_q = lambda x: isinstance(x, Blockwise8bit)  # noqa: E731
        g_leaves, treedef = jax.tree.flatten(grad_sums)
        p_leaves = treedef.flatten_up_to(params)
        mu_leaves = treedef.flatten_up_to(adam.mu)
        nu_leaves = treedef.flatten_up_to(adam.nu)
        dec_leaves = treedef.flatten_up_to(decayed) if decayed is not None else [False] * len(g_leaves)
        out = []
        for g, p, mu, nu, dec in zip(g_leaves, p_leaves, mu_leaves, nu_leaves, dec_leaves):
            dec = bool(dec)
            if use_kernel and is_q(mu) and self._fits(p):
                out.append(self._kernel_leaf(g, p, mu, nu, dec, glob, scalars, tables, hyper))
            else:
                out.append(self._xla_leaf(g, p, mu, nu, dec, grad, c1, c2, step))
        new_p = treedef.unflatten([o[0] for o in out])
        mu = treedef.unflatten([o[1] for o in out])
        nu = treedef.unflatten([o[2] for o in out])
        return new_p, (ScaleByAdam8bitState(count, mu, nu), decay_state, lr_state)

    def _fits(self, p) -> bool:
        per_layer = math.prod(p.shape[1:])
        return self.block_size == BLOCK and per_layer % BLOCK == 0

    def _kernel_leaf(self, g, p, mu, nu, decay, glob, scalars, tables, hyper):
        L = p.shape[0]
        rows_per_layer = math.prod(p.shape[1:]) // BLOCK
        tiles = dataclasses.replace(TILES, rows=math.gcd(TILES.rows, rows_per_layer))
        blocks = lambda x: x.reshape(L * rows_per_layer, BLOCK)  # noqa: E731
        new_p, mc, ma, vc, va = adam8bit_kernel(
            glob, scalars, blocks(g), blocks(p), blocks(mu.codes), mu.absmax.reshape(-1), blocks(nu.codes),
            nu.absmax.reshape(-1), tables, hyper=hyper, decay=decay, rows_per_layer=rows_per_layer, tiles=tiles,
            interpret=jax.default_backend() != "gpu")
        return (new_p.reshape(p.shape), Blockwise8bit(mc.reshape(mu.codes.shape), ma.reshape(mu.absmax.shape)),
                Blockwise8bit(vc.reshape(nu.codes.shape), va.reshape(nu.absmax.shape)))

    def _xla_leaf(self, g, p, mu, nu, decay, grad, c1, c2, step):
        """The chain's math on one leaf, one layer at a time (lax.map: one layer's temporaries at a time)."""

        def one(xs):
            g_l, p_l, mu_l, nu_l, c1_l, c2_l, step_l = xs
            g_l = grad(g_l)
            d, m, v = adam_leaf(g_l, mu_l, nu_l, c1=c1_l, c2=c2_l, b1=self.b1, b2=self.b2, eps=self.eps,
                                block_size=self.block_size)
            if decay:
                d = d + self.weight_decay * p_l
            u = jax.lax.optimization_barrier(jnp.array(step_l, dtype=d.dtype) * d)  # rounded before the add
            return jnp.asarray(p_l + u).astype(p_l.dtype), m, v

        return jax.lax.map(one, (g, p, mu, nu, c1, c2, step))


__all__ = ["FusedAdam8bit", "MODES", "mode"]
