"""MXFP4 expert weights as OpenAI publishes gpt-oss: `<name>_blocks` + `<name>_scales` pairs read as `<name>`.

The published checkpoints (config.json `quantization_config: {"quant_method": "mxfp4"}`) store each expert
projection as

    <name>_blocks  [E, out, in/32, 16] uint8   two E2M1 (fp4) codes per byte: low nibble = element 2j, high = 2j+1
    <name>_scales  [E, out, in/32]     uint8   E8M0 exponent of each block of 32: scale = 2^(s - 127)

value[e, o, 32 g + m] = FP4[code] * 2^(scales[e, o, g] - 127) (the OCP Microscaling MXFP4 format); the tensor
`<name>` the rest of the model uses is that [E, out, in] array with its last two axes swapped ([E, in, out], the
layout transformers' gpt_oss keeps for `mlp.experts.gate_up_proj` / `down_proj`), exactly as transformers'
`convert_moe_packed_tensors` dequantises it. Every value is exact in bfloat16 and float32 (a 2-bit significand
times a power of two), so dequantising loses nothing. The scale byte 0xFF is NaN in the spec: a checkpoint holding
one is refused, naming the tensor and the block.

Two ways to read a pair (`MXFP4Pair`, the `SafetensorsFile` reading interface):
- `get(name)`: dequantised, float32 [E, in, out] (full fine-tuning, merging an adapter, export);
- `packed()`: kept packed as the surojax.quant `mxfp4` format (its [E, out, in/32 * 17] block bytes: the E8M0
  byte, then 16 bytes of codes with element j in the low and j + 16 in the high nibble, as ggml and GGUF store
  MXFP4), 4.25 bits per value, the frozen base of LoRA and of serving. Only the order of the bytes changes
  (`MXFP4.from_blocks_scales`, as llama.cpp's convert_hf_to_gguf repacks gpt-oss): the format's `dequantize`
  gives the same values, and its `grouped_matmul` runs the experts.

`with_mxfp4_pairs(where)` wraps a checkpoint's name -> file map so that each complete pair appears as one virtual
tensor under the plain name; the pair's own names disappear from the map.
"""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from surojax.quant import MXFP4
from surojax.weights.safetensors_file import WeightsError

# E2M1 code -> value (sign bit 3), the table the published format uses.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
BLOCKS, SCALES = "_blocks", "_scales"
E8M0_NAN = 0xFF
BLOCK = 32  # values per scale


def _check_pair(blocks: np.ndarray, scales: np.ndarray, source: str) -> None:
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise WeightsError(f"{source}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not "
                           "pair (expected blocks [..., out, G, 16] and scales [..., out, G])")
    nan = np.argwhere(scales == E8M0_NAN)
    if len(nan):
        raise WeightsError(f"{source}: scale byte 0xFF (NaN in the OCP MX spec) at block {nan[0].tolist()} "
                           f"({len(nan)} block(s)); expected E8M0 exponents 0..254")


def _codes(blocks: np.ndarray) -> np.ndarray:
    """[..., G, 16] uint8 -> [..., G, 32] E2M1 codes in element order (low nibble first)."""
    return np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, source: str = "MXFP4") -> np.ndarray:
    """blocks [..., out, G, 16] uint8, scales [..., out, G] uint8 -> float32 [..., G*32, out] (in, out order)."""
    _check_pair(blocks, scales, source)
    with np.errstate(over="ignore"):  # 6 x 2^127 and up: inf, as in float arithmetic
        values = FP4_VALUES[_codes(blocks)] * np.exp2(scales.astype(np.float32) - 127.0)[..., None]
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
        return (*lead, groups * BLOCK, out)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16)  # what it holds exactly (see the module docstring)

    def _read(self) -> tuple[np.ndarray, np.ndarray]:
        blocks = self.blocks_file.get(self.name + BLOCKS)
        scales = self.scales_file.get(self.name + SCALES)
        for part, arr in ((BLOCKS, blocks), (SCALES, scales)):
            if arr.dtype != np.uint8:
                raise WeightsError(f"{self.path.name}: tensor {self.name + part} has dtype {arr.dtype}, "
                                   "expected uint8 (MXFP4)")
        return blocks, scales

    def get(self, name: str) -> np.ndarray:
        return dequantize_mxfp4(*self._read(), source=f"{self.path.name}: tensor {self.name}")

    def packed(self) -> MXFP4:
        """The pair as the `mxfp4` format: data [E, out, in/32 * 17] uint8 (numpy), shape (in, out)."""
        blocks, scales = self._read()
        _check_pair(blocks, scales, source=f"{self.path.name}: tensor {self.name}")
        return MXFP4.from_blocks_scales(blocks, scales)


def packed_stack(items: list, where: dict) -> MXFP4 | None:
    """One parameter's HF tensors `items` ((name, WeightRow, (layer,)), as hf_checkpoint.load_model groups them)
    as one `mxfp4` weight with jnp leaves [L, E, ...] (what the decoder's layer scan slices, as for any quantised
    kernel), when every one is a pair stored in the experts' [E, in, out] layout; else None."""
    if not all(isinstance(where[n], MXFP4Pair) and not row.transpose and row.half is None for n, row, _ in items):
        return None
    data, shape = None, None
    for i, (name, _, _) in enumerate(sorted(items, key=lambda item: item[2])):  # one host copy of the stack
        layer = where[name].packed()
        if data is None:
            data, shape = np.empty((len(items), *layer.data.shape), np.uint8), layer.shape
        data[i] = layer.data
    return MXFP4(data=jnp.asarray(data), shape=shape, negative_zero=True)


def with_mxfp4_pairs(where: dict) -> dict:
    """`where` (tensor name -> file) with every complete `_blocks` / `_scales` pair replaced by its plain name."""
    pairs = [n[: -len(BLOCKS)] for n in where if n.endswith(BLOCKS) and n[: -len(BLOCKS)] + SCALES in where]
    if not pairs:
        return where
    out = {n: f for n, f in where.items()}
    for base in pairs:
        out[base] = MXFP4Pair(base, out.pop(base + BLOCKS), out.pop(base + SCALES))
    return out
