"""The device mesh: axes ("stage", "data", "fsdp", "expert", "tensor") sized from the `parallel` section of the config.

    stage   pipeline parallelism: the stacked layers split into stages (surojax/parallel/pipeline.py runs the
            microbatch schedule); the batch is not split. Outermost, so that with several nodes the stages (whose
            traffic is one activation per microbatch) cross the slower links and the other axes stay within a node
    data    plain data parallelism: parameters replicated, batch split
    fsdp    ZeRO-3 / FSDP: parameters (and optimizer state) split on their `embed` axis, batch split too
    expert  expert parallelism (MoE): the experts split, E / expert per device; every other parameter replicated
            and the batch split, as data parallelism does (surojax/parallel/expert.py exchanges the tokens)
    tensor  Megatron tensor parallelism: heads / kv_heads / mlp / vocab split, batch not split

The global batch is the per-device batch x data x fsdp x expert (as in Megatron / DeepSpeed expert parallelism).

One size may be -1: "the rest of the devices" (the device count divided by the other sizes). The product of
the sizes must equal the device count; anything else is an error that names the sizes and the count.

Axis types are `Auto` (GSPMD propagation: XLA chooses the collectives from the shardings of the inputs and
outputs of a jitted function). `jax.make_mesh` defaults to `Explicit` axes in JAX 0.11, under which every
reshape / einsum of a sharded array must state its output sharding; the model code names no mesh axes, so
explicit axes would not compile it. Callers that want them pass `axis_types`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, ...] = ("stage", "data", "fsdp", "expert", "tensor")
REST = -1  # "the rest of the devices"


class MeshError(ValueError):
    """Mesh sizes that do not fit the devices."""

    is_user_error = True


def _sizes_of(parallel: Mapping[str, int] | None) -> dict[str, int]:
    """Read the mesh axes' sizes from a mapping of axis sizes (`ParallelConfig.sizes()`); a missing one is 1."""
    raw = dict(parallel or {})
    unknown = sorted(set(raw) - set(MESH_AXES))
    if unknown:
        raise MeshError(f"parallel has unknown key(s) {', '.join(map(repr, unknown))}; "
                        f"mesh axes are {', '.join(MESH_AXES)}")
    sizes = {}
    for axis in MESH_AXES:
        v = raw.get(axis, 1)
        if v is None:
            v = 1
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != REST):
            raise MeshError(f"parallel.{axis} = {v!r}: expected a positive int or -1 (the rest of the devices)")
        sizes[axis] = v
    return sizes


def mesh_shape(parallel: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """{axis: size} for `num_devices` devices, with a -1 resolved. Pure arithmetic (no devices needed)."""
    sizes = _sizes_of(parallel)
    given = ", ".join(f"{a}={s}" for a, s in sizes.items())
    rest = [a for a, s in sizes.items() if s == REST]
    if len(rest) > 1:
        raise MeshError(f"parallel ({given}): at most one size may be -1, got {len(rest)} ({', '.join(rest)})")
    fixed = math.prod(s for s in sizes.values() if s != REST)
    if rest:
        if num_devices % fixed:
            raise MeshError(f"parallel ({given}): the fixed sizes multiply to {fixed}, which does not divide "
                            f"the {num_devices} devices, so {rest[0]}=-1 cannot take the rest")
        sizes[rest[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(f"parallel ({given}): the sizes multiply to {fixed} but there are {num_devices} devices; "
                        f"their product must equal the device count (set one size to -1 to take the rest)")
    return sizes


def make_mesh(parallel: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None, *,
              axis_types: tuple[AxisType, ...] | None = None) -> Mesh:
    """A Mesh with axes ("stage", "data", "fsdp", "expert", "tensor") over `devices` (default: all devices of all
    processes).

    `parallel` is a mapping (the config's `ParallelConfig.sizes()`) of `stage`, `data`, `fsdp`, `expert`, `tensor`; a missing
    size is 1 and one size may be -1. `jax.make_mesh` orders the devices for the interconnect topology.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(parallel, len(devices))
    if axis_types is None:
        axis_types = (AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types, devices=devices)
