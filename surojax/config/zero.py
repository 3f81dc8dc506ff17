"""`zero_stage`: how much of the training state is split over the data-parallel devices (ZeRO, Rajbhandari et al.
2020), and the mesh the run therefore uses.

    0  everything replicated over `data` (plain DDP: the gradients are all-reduced)
    1  the optimizer state (AdamW moments, the 8-bit AdamW state) split over `data`, the parameters replicated:
       each device updates its shard of the parameters, then the updated parameters are all-gathered
    2  as 1, and the gradients reduce-scattered to the optimizer state's split before the update (the
       accumulated gradients are never whole on a device)
    3  the parameters too: `zero_stage: 3` over N data devices IS `parallel: {fsdp: N}` (ZeRO-3 / FSDP). With
       `parallel.fsdp: 1` the data axis is respelled as the fsdp axis (`mesh_sizes()`); with `parallel.fsdp > 1`
       the mesh is taken as written (data > 1 beside it: replicas of fsdp groups, "hybrid sharding"). There is
       no second implementation of stage 3.

Unset, the stage is what the mesh already does: 3 when parallel.fsdp > 1, else 0. A stage below 3 with
parallel.fsdp > 1 contradicts the mesh and is refused (config/rules.py), as are stages 1 and 2 with
offload_optimizer / offload_master (the host-resident state of those is updated layer by layer, unsplit).
The split itself is surojax/parallel/zero.py's.
"""
from __future__ import annotations

from typing import Literal

from surojax.config.parallel import ParallelSection

ZeroStage = Literal[0, 1, 2, 3]


class ZeroSection(ParallelSection):
    """`zero_stage: 0 | 1 | 2 | 3` beside `parallel:` (it reads the mesh, hence derived from its section)."""

    zero_stage: ZeroStage | None = None
    """ZeRO stage over the data-parallel devices: 0 replicated (DDP), 1 optimizer state sharded, 2 also gradients
    reduce-scattered, 3 parameters too (= parallel: {fsdp: N}). Default: 3 when parallel.fsdp > 1, else 0."""

    @property
    def resolved_zero_stage(self) -> int:
        """The stage this run trains with (the default resolved against the mesh)."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 3 if self.parallel.fsdp != 1 else 0

    def mesh_sizes(self) -> dict[str, int]:
        """The mesh axis sizes the run uses (make_mesh's argument): parallel's, with `zero_stage: 3` over the data
        axis spelled as the fsdp axis ({data: N, fsdp: 1} -> {data: 1, fsdp: N}; N may be -1, the rest)."""
        sizes = self.parallel.sizes()
        if self.resolved_zero_stage == 3 and sizes["fsdp"] == 1:
            sizes["fsdp"], sizes["data"] = sizes["data"], 1
        return sizes
