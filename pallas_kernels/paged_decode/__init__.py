"""Paged decode attention: `kernel.py` (Pallas / Triton), `reference.py` (pure jnp), `api.py` (the public
function, its knobs and where it applies). Imports nothing from surojax."""
from pallas_kernels.paged_decode.api import (kernel_applies, max_pool_blocks, num_partitions, paged_decode_attention,
                                             prepare)
from pallas_kernels.paged_decode.reference import paged_decode_reference

__all__ = ["kernel_applies", "max_pool_blocks", "num_partitions", "paged_decode_attention", "paged_decode_reference",
           "prepare"]
