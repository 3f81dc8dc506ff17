"""8-bit AdamW's update of a stacked parameter in one pass: `kernel.py` (Pallas / Triton), `reference.py` (pure
jnp, the same operations), `api.py` (the backend choice). The operands (code tables, per-layer scalars) are built by
surojax/train/optim_8bit_fused.py, whose XLA per-layer form (surojax/train/optim_8bit.py) the fused update is also
held to. Imports nothing from surojax."""
from pallas_kernels.adam8bit.api import adam8bit_update
from pallas_kernels.adam8bit.kernel import BLOCK, Adam8bitHyper, Adam8bitTiles, adam8bit_kernel
from pallas_kernels.adam8bit.reference import adam8bit_reference

__all__ = ["BLOCK", "Adam8bitHyper", "Adam8bitTiles", "adam8bit_kernel", "adam8bit_reference", "adam8bit_update"]
