"""8-bit AdamW's update of a stacked parameter in one pass (`kernel.py`, Pallas / Triton). Its reference is the XLA
form in surojax/train/optim_8bit.py, which builds the operands (tables, per-layer scalars). Imports nothing from
surojax."""
from pallas_kernels.adam8bit.kernel import BLOCK, Adam8bitHyper, Adam8bitTiles, adam8bit_kernel

__all__ = ["BLOCK", "Adam8bitHyper", "Adam8bitTiles", "adam8bit_kernel"]
