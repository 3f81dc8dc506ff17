"""Logical axes -> mesh axes: the rules tables, and placing a built model by them.

Model code tags every parameter with logical axis names (`vocab`, `embed`, `heads`, ...; see
surojax.models.layers.params) and never names a mesh axis. This module holds the only mapping from those
names to the mesh axes of surojax.parallel.mesh, one table for parameters and one for activations:

    parameter   q_proj.kernel [L, D, N*H]  axes (layers, embed, heads)  -> P(None, 'fsdp', 'tensor')
    parameter   experts.gate_up_proj.kernel [L, E, D, 2F]  axes (layers, experts, embed, mlp)
                                                                  -> P(None, 'expert', 'fsdp', 'tensor')
    activation  tokens [B, T]              axes (batch, seq)            -> P(('data', 'fsdp', 'expert'), None)

Resolving one array's spec (`partition_spec`), dimension by dimension, left to right:
  * a logical name maps to None, one mesh axis or a tuple of mesh axes (the dimension is split over their
    product); a name missing from the table is an error (add it to the table, None to replicate);
  * a mesh axis of size 1 splits nothing and is left out (so a run without expert parallelism keeps the
    specs it always had);
  * a mesh axis already used by an earlier dimension of the same array is skipped (a mesh axis may shard
    only one dimension);
  * a mesh axis whose size does not divide what is left of the dimension is skipped, so an odd vocabulary
    stays whole on a tensor axis of 2 instead of failing; both skips are logged at debug level.

Placement is applied from outside the model, in one of three ways:
  * `shard_model(model, mesh)` moves the arrays of a built model in place (device_put + nnx.update);
  * `param_shardings(model, mesh)` gives the shardings as an nnx.State-shaped tree, for `jax.jit`'s
    in_shardings / out_shardings (train state, optimizer state built from it);
  * `init_sharded(make_model, mesh)` builds a model directly sharded (shapes from nnx.eval_shape, values
    from a jit whose out_shardings are the rules), so no device ever holds the whole model.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from surojax.models.layers.params import AXES

log = logging.getLogger(__name__)

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]
M = TypeVar("M", bound=nnx.Module)

# Parameters: FSDP splits the model dimension of every matrix (and the norms' scales); tensor parallelism
# splits what a Megatron layer splits (heads, kv heads, the MLP hidden, the vocabulary). `layers` splits over the
# pipeline stages (contiguous blocks of L / stage layers, surojax/parallel/pipeline.py); with stage = 1 the rule
# drops out (a size-1 axis splits nothing) and the scan slices the whole stack as before.
PARAM_RULES: Rules = MappingProxyType({
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",  # N*H flattened: heads divide evenly when N is a multiple of the tensor size
    "kv_heads": "tensor",  # K*H flattened: with K < tensor size the split falls inside a head (still correct)
    "head_dim": None,
    "mlp": "tensor",
    "layers": "stage",
    "experts": "expert",  # E / expert experts per device; surojax/parallel/expert.py sends the tokens to them
})

# Activations and inputs: the batch is split over every data-like axis (data, fsdp and expert: expert parallelism
# splits the batch as data parallelism does), the rest follows tensor parallelism. For with_sharding_constraint
# in steps and for the [B, T] inputs (`batch_sharding`). "expert" is last so that the devices of one expert group
# hold consecutive rows of the batch (the token exchange of surojax/parallel/expert.py gathers over that group).
ACTIVATION_RULES: Rules = MappingProxyType({
    "batch": ("data", "fsdp", "expert"),
    "seq": None,
    "kv_seq": None,
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "experts": None,
})


def zero_rules(rules: Rules = PARAM_RULES, axis: str = "data") -> Rules:
    """`rules` with `embed` also split over mesh axis `axis`: the layout ZeRO-1/2 give the optimizer state and
    the gradients over the data devices while the parameters keep `rules` (surojax/parallel/zero.py)."""
    return MappingProxyType({**rules, "embed": (*_as_tuple(rules["embed"]), axis)})


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def partition_spec(logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh | jax.sharding.AbstractMesh,
                   shape: Sequence[int] | None = None) -> P:
    """The PartitionSpec of one array whose dimensions carry `logical_axes` (None = not named, replicated).

    `shape` enables the divisibility check; without it every rule is taken as written. `mesh` only needs its
    axis sizes, so an AbstractMesh works as well.
    """
    sizes = dict(mesh.shape)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for i, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; rules name {', '.join(sorted(rules))} "
                           f"(add {name!r} to the rules table, mapped to None to replicate it)")
        chosen: list[str] = []
        split = 1  # product of the mesh axes chosen so far for this dimension
        for axis in _as_tuple(rules[name]):
            if axis not in sizes:
                raise KeyError(f"rule {name!r} -> {rules[name]!r} names mesh axis {axis!r}, but the mesh has "
                               f"axes {', '.join(sizes)}")
            if sizes[axis] == 1:
                continue
            if axis in used:
                log.debug("dim %d (%s): mesh axis %r already shards another dimension; not used again",
                          i, name, axis)
                continue
            if shape is not None and shape[i] % (split * sizes[axis]):
                log.debug("dim %d (%s) of shape %s: size %d is not divisible by %s=%d (times %d already); "
                          "not split over %r", i, name, tuple(shape), shape[i], axis, sizes[axis], split, axis)
                continue
            chosen.append(axis)
            split *= sizes[axis]
            used.add(axis)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*spec)


def named_sharding(logical_axes: Sequence[str | None], mesh: Mesh, rules: Rules,
                   shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, rules, mesh, shape))


def batch_sharding(mesh: Mesh, rules: Rules = ACTIVATION_RULES) -> NamedSharding:
    """Sharding of [B, T] inputs (tokens, positions, segment ids, loss mask): rows over the data-like axes.

    No divisibility fallback here: a batch that does not split evenly is an error from device_put / jit,
    not a silently replicated batch.
    """
    return named_sharding(("batch", "seq"), mesh, rules)


def batch_axes(mesh: Mesh | jax.sharding.AbstractMesh, rules: Rules = ACTIVATION_RULES) -> tuple[str, ...]:
    """The mesh axes that split the batch (the `batch` rule), in order, all of them (size 1 included)."""
    return tuple(a for a in _as_tuple(rules["batch"]) if a in mesh.shape)


def batch_parallel_size(mesh: Mesh | jax.sharding.AbstractMesh, rules: Rules = ACTIVATION_RULES) -> int:
    """How many ways the batch is split: data x fsdp x expert. Global batch = per-device batch x this."""
    sizes = dict(mesh.shape)
    return math.prod(sizes[a] for a in batch_axes(mesh, rules))


def _variable_sharding(var: nnx.Variable, mesh: Mesh, rules: Rules, path) -> Any:
    """The sharding tree of one Variable's value: by its `axes` metadata, replicated when it has none.

    A quantised weight's value is a pytree of arrays; each leaf of the same rank as the axes is placed by
    them (the divisibility check keeps packed / blocked dimensions legal), any other leaf is replicated.
    """
    axes = var.get_metadata().get(AXES)

    def leaf_sharding(leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        if axes is None or len(axes) != len(shape):
            if axes is not None:
                log.debug("%s: leaf of shape %s does not match axes %s; replicated", path, shape, axes)
            return NamedSharding(mesh, P())
        return named_sharding(axes, mesh, rules, shape)

    return jax.tree.map(leaf_sharding, var.get_value())


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_shardings(model_or_state: nnx.Module | nnx.State, mesh: Mesh, rules: Rules = PARAM_RULES, *,
                    filter: Any = nnx.Param) -> nnx.State:
    """NamedShardings shaped like `nnx.state(model, filter)` (Variables whose values are shardings).

    Use as in_shardings / out_shardings of a jax.jit over that state, or as the target of jax.device_put.
    Given a State, maps it as it is (its own filter applies). Works on abstract models (nnx.eval_shape).
    """
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, filter)
    return jax.tree_util.tree_map_with_path(
        lambda path, v: v.replace(_variable_sharding(v, mesh, rules, _path_str(path)))
        if isinstance(v, nnx.Variable) else NamedSharding(mesh, P()),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: M, mesh: Mesh, rules: Rules = PARAM_RULES) -> M:
    """Place every Variable of a built model on `mesh` by the rules (in place; returns the model).

    All variables move, not only Params: a Variable without `axes` (an RNG key, a counter) is replicated, so
    the whole model lives on the mesh's devices and a jit over it sees no committed single-device array.
    """
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


def init_sharded(make_model: Callable[[], M], mesh: Mesh, rules: Rules = PARAM_RULES) -> M:
    """Build `make_model()` with every array created directly in its shard.

    Shapes come from nnx.eval_shape (nothing allocated); the values are computed by a jit whose
    out_shardings are the rules, so each device computes and holds only its own shards. With JAX's
    partitionable threefry (the default) the values equal those of an unsharded `make_model()`.
    """
    abstract = nnx.eval_shape(make_model)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract_state, mesh, rules)

    def build():
        return nnx.state(make_model())

    state = jax.jit(build, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def sharding_report(model: nnx.Module) -> str:
    """One line per array: path, shape, dtype, partition spec. For logs and debugging."""
    lines = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        for leaf in jax.tree.leaves(var.get_value()):
            spec = getattr(getattr(leaf, "sharding", None), "spec", None)
            lines.append(f"{'.'.join(map(str, path))} {tuple(leaf.shape)} {leaf.dtype} {spec}")
    return "\n".join(lines)


__all__ = [
    "PARAM_RULES", "ACTIVATION_RULES", "Rules", "zero_rules", "partition_spec", "named_sharding", "batch_sharding", "batch_axes",
    "batch_parallel_size",
    "param_shardings", "shard_model", "init_sharded", "sharding_report",
]
