"""FP8 checkpoints with block scales, as transformers' FineGrainedFP8 writes and reads them (quant_method "fp8":
Qwen3-*-FP8, DeepSeek-V3 / R1, MiniMax):

    config.json  quantization_config: {"quant_method": "fp8", "weight_block_size": [bn, bk] (or null: one scale per
                 tensor), "activation_scheme": "dynamic" | "static", "fmt": "e4m3", "scale_fmt": "float",
                 "modules_to_not_convert": [...]}
    <module>.weight            F8_E4M3 [N, K]                      (out, in)
    <module>.weight_scale_inv  F32 (or BF16) [ceil(N/bn), ceil(K/bk)]   x = weight * weight_scale_inv
    <module>.activation_scale  (static activations; not used: surojax runs the weight only)

-> surojax.quant.FP8Block(data = weight, scale = weight_scale_inv widened to fp32, block = (bn, bk)): the same
arrays, so nothing is rounded and dequantisation is transformers' `Fp8Dequantize` bit for bit (weight * scale in
float32). A partial last block (N or K not a multiple of the block) is held as stored and read with the block of
weight_block_size, as DeepSeek's weight_dequant kernel and compressed-tensors read it; transformers'
`Fp8Dequantize` derives the block from the scale grid instead (rows // scale rows) and refuses or misreads such a
weight, so there the reference is compressed-tensors' `dequantize` (the ct_fp8 fixture's down_proj, [64, 128] in
one 128 x 128 block: tests/weights/test_prequant.py).

Which modules are quantised comes from the tensors: those with a weight_scale_inv. A module listed in
modules_to_not_convert, or one transformers' quantiser skipped because its shape does not divide, is stored in
float and loads as one. Refused: scale_fmt "ue8m0" (E8M0 power-of-two scales, DeepSeek-V3.1 style) and E5M2
weights.

`fp8_weight` (the FP8Block of one stored weight and its scale grid) is shared with the compressed-tensors and
ModelOpt FP8 readers.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from surojax.quant.fp8 import FP8Block
from surojax.weights.prequant.base import (FLOAT_SCALES, Claims, PrequantError, QuantScheme, Stored, cdiv,
                                           expect_shape, refuse_unclaimed, tensor, with_suffix)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE = ".weight_scale_inv"
ACTIVATION_SCALES = (".activation_scale", ".input_scale")


def fp8_weight(where: dict, stored: Stored, block: tuple[int, int] | None, what: str) -> FP8Block:
    """The FP8Block of `stored` (parts["scale"] its scale grid): block (bn, bk) -> scale [ceil(N/bn), ceil(K/bk)];
    None -> one scale for the tensor (shape [], [1] or [1, 1]). `what` names the scheme in errors."""
    w = tensor(where, stored.weight, (E4M3,), ndim=2)
    n, k = w.shape
    name = stored.parts["scale"]
    scale = tensor(where, name, FLOAT_SCALES)
    if block is None:
        expect_shape(where, name, scale, [(), (1,), (1, 1)], f"{what}: one scale per tensor")
        block = (n, k)
    else:
        bn, bk = block
        expect_shape(where, name, scale, [(cdiv(n, bn), cdiv(k, bk))],
                     f"{what}: one scale per {bn} x {bk} block of the weight [{n}, {k}]")
    scale = scale.astype(np.float32).reshape(cdiv(n, block[0]), cdiv(k, block[1]))  # bf16 / fp16 -> fp32: exact
    return FP8Block(data=w, scale=scale, shape=(k, n), block=tuple(int(b) for b in block))


class FineGrainedFP8(QuantScheme):
    method = "fp8"
    format = "fp8"

    def __init__(self, source: Path, block: tuple[int, int] | None):
        self.source, self.block = source, block

    @classmethod
    def from_config(cls, config: dict, source: Path) -> "FineGrainedFP8":
        self = cls(source, None)
        fmt = config.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise self.config_error("fmt", "\"e4m3\" (E5M2 weights are not supported)", fmt)
        scale_fmt = config.get("scale_fmt") or "float"
        if scale_fmt != "float":
            raise self.config_error("scale_fmt", "\"float\" (fp32 scales; E8M0 \"ue8m0\" scales are not supported)",
                                    scale_fmt)
        scheme = config.get("activation_scheme", "dynamic")  # weight-only either way (activation scales not used)
        if scheme not in ("dynamic", "static"):
            raise self.config_error("activation_scheme", "\"dynamic\" or \"static\"", scheme)
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2
                    and all(type(b) is int and b > 0 for b in block)):
                raise self.config_error("weight_block_size", "two positive integers [rows, columns] or null", block)
            block = (block[0], block[1])
        return cls(source, block)

    def describe(self) -> str:
        grain = "one scale per tensor" if self.block is None else f"{self.block[0]} x {self.block[1]} block scales"
        return f"fp8 (transformers fine-grained FP8, E4M3, {grain}) -> surojax fp8"

    def claim(self, where: dict) -> Claims:
        weights = {}
        for module in with_suffix(where, SCALE):
            weight = f"{module}.weight"
            if weight not in where:
                raise PrequantError(f"{where[module + SCALE].path}: tensor {module + SCALE} has no {weight}")
            unused = tuple(module + s for s in ACTIVATION_SCALES if module + s in where)
            weights[weight] = Stored(weight, {"scale": module + SCALE}, unused)
        refuse_unclaimed(where, weights, (E4M3,), f"quant_method fp8 stores <module>.weight with <module>{SCALE}")
        return Claims(weights)

    def read(self, stored: Stored, where: dict) -> FP8Block:
        return fp8_weight(where, stored, self.block, f"{self.source.name}: quant_method fp8")
