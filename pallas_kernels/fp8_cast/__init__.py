"""FP8 cast + transpose + amax in one pass: `kernel.py` (Pallas / Triton), `reference.py` (pure jnp), `api.py` (the
backend choice). Imports nothing from surojax."""
from pallas_kernels.fp8_cast.api import CAST_TILES, cast_transpose, kernel_fits
from pallas_kernels.fp8_cast.kernel import CastTiles, cast_transpose_kernel
from pallas_kernels.fp8_cast.reference import cast_transpose_reference

__all__ = ["CAST_TILES", "CastTiles", "cast_transpose", "cast_transpose_kernel", "cast_transpose_reference",
           "kernel_fits"]
