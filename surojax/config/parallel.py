"""Parallel keys: the device mesh as sizes of named axes (-1 means all the devices the others leave), and how the
pipeline stages schedule their microbatches."""
from __future__ import annotations

from pydantic import Field, field_validator

from surojax.config.base import StrictModel

MESH_AXES = ("data", "fsdp", "tensor", "expert", "stage")


class ParallelConfig(StrictModel):
    """`parallel: {data: -1, fsdp: 1, tensor: 1, stage: 1}`. At most one axis is -1 (checked in rules.py).

    The global batch is per_device_train_batch_size x data x fsdp x expert; tensor and stage do not split it.
    """

    data: int = -1
    """Data-parallel replicas (each holds a full copy of what fsdp does not shard)."""
    fsdp: int = 1
    """Shard parameters, gradients and optimizer state over this many devices (ZeRO-3)."""
    tensor: int = 1
    """Tensor (Megatron-style) parallelism within a layer."""
    expert: int = 1
    """Expert parallelism for MoE layers."""
    stage: int = 1
    """Pipeline stages: the stacked layers split into `stage` blocks (the layer count must be a multiple of
    stage x pipeline_repeats), each device holding its stage's layers; the batch runs through them as
    `pipeline_microbatches` microbatches on a circular schedule (surojax/parallel/pipeline.py). 1: no pipeline
    (the plain layer scan)."""
    pipeline_microbatches: int | None = Field(default=None, ge=1)
    """Microbatches per step with stage > 1 (refused with stage 1). Must divide per_device_train_batch_size
    (the rows of one data shard). Default: its largest divisor that is at most 2 x stage. The idle share of each
    stage (the bubble, printed at start) is (stage-1) / (microbatches x repeats + stage-1) when microbatches >=
    stage."""
    pipeline_repeats: int = Field(default=1, ge=1)
    """Circular (interleaved) pipelining with stage > 1 (refused otherwise): each stage holds `pipeline_repeats`
    chunks of layers (stage s: chunks s, s + stage, ...) and every microbatch passes the stages that many times,
    dividing the bubble by about that factor; the stage's layers are regathered every step (all-to-all over
    `stage`) since its chunks are not contiguous. 1: one contiguous block of layers per stage."""

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
