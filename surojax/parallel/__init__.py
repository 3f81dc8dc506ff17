"""Parallelism applied to a built model from outside: the mesh (mesh.py), the logical->mesh rules (rules.py) and
expert parallelism for MoE layers (expert.py)."""
from surojax.parallel.mesh import MESH_AXES, MeshError, make_mesh, mesh_shape
from surojax.parallel.rules import (
    ACTIVATION_RULES,
    PARAM_RULES,
    batch_axes,
    batch_parallel_size,
    batch_sharding,
    init_sharded,
    named_sharding,
    param_shardings,
    partition_spec,
    shard_model,
    sharding_report,
)

__all__ = [
    "MESH_AXES", "MeshError", "make_mesh", "mesh_shape", "ACTIVATION_RULES", "PARAM_RULES", "batch_axes",
    "batch_parallel_size", "batch_sharding", "init_sharded", "named_sharding", "param_shardings", "partition_spec",
    "shard_model", "sharding_report",
]
