"""Parallel keys: the device mesh as sizes of named axes; -1 means all the devices the others leave."""
from __future__ import annotations

from pydantic import Field, field_validator

from surojax.config.base import StrictModel

MESH_AXES = ("data", "fsdp", "tensor", "expert", "stage")


class ParallelConfig(StrictModel):
    """`parallel: {data: -1, fsdp: 1, tensor: 1}`. At most one axis is -1 (checked in rules.py)."""

    data: int = -1
    """Data-parallel replicas (each holds a full copy of what fsdp does not shard)."""
    fsdp: int = 1
    """Shard parameters, gradients and optimizer state over this many devices (ZeRO-3)."""
    tensor: int = 1
    """Tensor (Megatron-style) parallelism within a layer."""
    expert: int = 1
    """Expert parallelism for MoE layers."""
    stage: int = 1
    """Pipeline stages over the stacked layers axis."""

    @field_validator(*MESH_AXES)
    @classmethod
    def _size(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"must be a positive device count or -1 for the rest (got {v})")
        return v

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}


class ParallelSection(StrictModel):
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
