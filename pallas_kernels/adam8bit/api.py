"""`adam8bit_update(...)`: one 8-bit AdamW step over a stacked parameter's 256-value blocks, the backend chosen.

On a GPU the Pallas kernel (kernel.py) does it in one pass, in place; elsewhere the pure-jnp reference
(reference.py: the same operations in the same order, several XLA passes); interpret mode runs the kernel off the
GPU (tests). Operands and results: kernel.py's `adam8bit_kernel`.
"""
from __future__ import annotations

import jax

from pallas_kernels.adam8bit.kernel import Adam8bitHyper, Adam8bitTiles, adam8bit_kernel
from pallas_kernels.adam8bit.reference import adam8bit_reference


def adam8bit_update(glob, layer_scalars, g, p, m_codes, m_absmax, v_codes, v_absmax, tables, *,
                    hyper: Adam8bitHyper, decay: bool, rows_per_layer: int, tiles: Adam8bitTiles = Adam8bitTiles(),
                    use_kernel: bool | None = None, interpret: bool | None = None):
    """(p, m_codes, m_absmax, v_codes, v_absmax). use_kernel None: the kernel on a GPU, the reference elsewhere;
    interpret None: interpret mode off the GPU. tiles.rows must divide rows_per_layer (kernel only)."""
    on_gpu = jax.default_backend() == "gpu"
    if use_kernel is None:
        use_kernel = on_gpu
    operands = (glob, layer_scalars, g, p, m_codes, m_absmax, v_codes, v_absmax, tables)
    if not use_kernel:
        return adam8bit_reference(*operands, hyper=hyper, decay=decay, rows_per_layer=rows_per_layer)
    if rows_per_layer % tiles.rows:
        raise ValueError(f"adam8bit_update: tiles.rows={tiles.rows} does not divide rows_per_layer={rows_per_layer}")
    return adam8bit_kernel(*operands, hyper=hyper, decay=decay, rows_per_layer=rows_per_layer, tiles=tiles,
                           interpret=not on_gpu if interpret is None else interpret)


__all__ = ["adam8bit_update"]
