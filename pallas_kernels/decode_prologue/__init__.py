"""The decode prologue: between an attention layer's joined QKV GEMV and its paged decode attention, the split of qkv,
the per-head q / k RMSNorm, rope on q and k and the write of k / v into the paged pool, as one Pallas kernel:
`kernel.py` (Pallas / Triton), `reference.py` (pure jnp), `api.py` (the public call and the mode choice). Imports
nothing from surojax."""
from pallas_kernels.decode_prologue.api import (MAX_ROWS, MODES, NORMS, PrologueKnobs, choose, decode_prologue,
                                                unsupported)
from pallas_kernels.decode_prologue.reference import decode_prologue_ref

__all__ = ["MAX_ROWS", "MODES", "NORMS", "PrologueKnobs", "choose", "decode_prologue", "decode_prologue_ref",
           "unsupported"]
