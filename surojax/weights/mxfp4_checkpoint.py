"""MXFP4 expert weights as OpenAI publishes gpt-oss: `<name>_blocks` + `<name>_scales` pairs read as `<name>`.

The published checkpoints (config.json `quantization_config: {"quant_method": "mxfp4"}`) store each expert
projection as

    <name>_blocks  [E, out, in/32, 16] uint8   two E2M1 (fp4) codes per byte: low nibble = element 2j, high = 2j+1
    <name>_scales  [E, out, in/32]     uint8   E8M0 exponent of each block of 32: scale = 2^(s - 127)

value[e, o, 32 g + m] = FP4[code] * 2^(scales[e, o, g] - 127); the bf16 tensor `<name>` the rest of the model
uses is that [E, out, in] array with its last two axes swapped ([E, in, out], the layout transformers' gpt_oss
keeps for `mlp.experts.gate_up_proj` / `down_proj`), exactly as transformers' `convert_moe_packed_tensors`
dequantises it. Every value is exact in bfloat16 and float32 (a 3-bit significand times a power of two), so
dequantising on load loses nothing.

`with_mxfp4_pairs(where)` wraps a checkpoint's name -> file map so that each complete pair appears as one virtual
tensor under the plain name (dequantised when read); the pair's own names disappear from the map.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from surojax.weights.safetensors_file import WeightsError

# E2M1 code -> value (sign bit 3), the table the published format uses.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., out, G, 16] uint8, scales [..., out, G] uint8 -> float32 [..., G*32, out] (in, out order)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise WeightsError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
                           "(expected blocks [..., out, G, 16] and scales [..., out, G])")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # [..., out, G, 32]
    values = FP4_VALUES[codes] * np.exp2(scales.astype(np.float32) - 127.0)[..., None]
    values = values.reshape(*blocks.shape[:-2], -1)  # [..., out, in]
    return np.ascontiguousarray(np.swapaxes(values, -1, -2))


class MXFP4Pair:
    """A virtual tensor (the `SafetensorsFile` reading interface) made of one `_blocks` / `_scales` pair."""

    def __init__(self, name: str, blocks_file, scales_file):
        self.name = name
        self.blocks_file, self.scales_file = blocks_file, scales_file
        self.path = Path(blocks_file.path)

    def shape(self, name: str) -> tuple[int, ...]:
        *lead, out, groups, _ = self.blocks_file.shape(self.name + BLOCKS)
        return (*lead, groups * 32, out)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16)  # what it holds exactly (see the module docstring)

    def get(self, name: str) -> np.ndarray:
        blocks = self.blocks_file.get(self.name + BLOCKS)
        scales = self.scales_file.get(self.name + SCALES)
        for part, arr in ((BLOCKS, blocks), (SCALES, scales)):
            if arr.dtype != np.uint8:
                raise WeightsError(f"{self.path.name}: tensor {self.name + part} has dtype {arr.dtype}, "
                                   "expected uint8 (MXFP4)")
        return dequantize_mxfp4(blocks, scales)


def with_mxfp4_pairs(where: dict) -> dict:
    """`where` (tensor name -> file) with every complete `_blocks` / `_scales` pair replaced by its plain name."""
    pairs = [n[: -len(BLOCKS)] for n in where if n.endswith(BLOCKS) and n[: -len(BLOCKS)] + SCALES in where]
    if not pairs:
        return where
    out = {n: f for n, f in where.items()}
    for base in pairs:
        out[base] = MXFP4Pair(base, out.pop(base + BLOCKS), out.pop(base + SCALES))
    return out
