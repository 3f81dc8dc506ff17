"""A stacked per-layer weight [L, ...] kept in host memory as L separate buffers, one per layer.

Why (benchmarks/host_copy_overlap.py; figures in benchmarks/RESULTS.md#s3-streaming): XLA moves a slice of a stacked
pinned-host array to the device either as a dynamic-slice kernel that reads host memory over PCIe on the compute
stream, or as a synchronous copy; either way the copy runs serially with the matmuls, even in a prefetching scan
over the stack. A whole host buffer moved with `jax.device_put` inside jit becomes an asynchronous copy
(copy-start / copy-done, a DMA on its own stream) that XLA's scheduler overlaps with the compute, so L buffers
fetched one layer ahead in an unrolled loop hide most of the transfer.
So `offload_prefetch` keeps the streamed base as `HostLayers` and the prefetching loop (prefetch.py) walks the
layers in Python, fetching buffer l+1 while layer l computes.

    HostLayers(layers)    a pytree node whose children are the L arrays [...] (each in pinned host memory);
                          `shape` is the stacked [L, ...] it stands for
    split_layers(x, s)    stacked x [L, ...] (numpy, or a jax array off the device) -> HostLayers placed with the
                          per-layer form of sharding s (its memory kind, its spec without the layer axis)
"""
from __future__ import annotations

import jax


@jax.tree_util.register_pytree_node_class
class HostLayers:
    """L per-layer arrays standing for one stacked [L, ...] weight (see the module docstring)."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        if not self.layers:
            raise ValueError("HostLayers needs at least one layer")

    def tree_flatten(self):
        return self.layers, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> tuple:
        return (len(self.layers), *self.layers[0].shape)

    def __repr__(self) -> str:
        return f"HostLayers({len(self.layers)} x {tuple(self.layers[0].shape)} {self.layers[0].dtype})"


def is_host_layers(x) -> bool:
    return isinstance(x, HostLayers)


def layer_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of one layer [...] of an array sharded as [L, ...] by `sharding` (same memory kind)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)[1:]
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec),
                                          memory_kind=sharding.memory_kind)
    return sharding  # single-device shardings carry no per-axis spec


def split_layers(x, sharding: jax.sharding.Sharding) -> HostLayers:
    """Stacked x [L, ...] -> HostLayers of x[0], ..., x[L-1], each put with `layer_sharding(sharding)`.

    x is sliced where it lives (numpy, or the CPU backend where `streaming.build_context` builds a streamed
    base), one layer at a time, so the host never holds a second copy of the whole stack."""
    s = layer_sharding(sharding)
    n = x.shape[0]
    return HostLayers(jax.device_put(x[l], s) for l in range(n))


def contains_host_layers(tree) -> bool:
    return any(is_host_layers(x) for x in jax.tree.leaves(tree, is_leaf=is_host_layers))


__all__ = ["HostLayers", "contains_host_layers", "is_host_layers", "layer_sharding", "split_layers"]
