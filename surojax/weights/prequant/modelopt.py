"""NVIDIA ModelOpt exports (`export_hf_checkpoint`: nvidia/*-FP4, *-NVFP4, *-FP8): quant_method "modelopt" in
config.json's quantization_config, or hf_quant_config.json ({"producer": {"name": "modelopt"}, "quantization":
{"quant_algo": ..., "group_size": 16, "kv_cache_quant_algo": ..., "exclude_modules": [...]}}) in older exports.

quant_algo "NVFP4" (W4A4; the weight is read):
    <module>.weight          U8 [N, K/2]        two E2M1 codes per byte, element 2j in the LOW nibble
    <module>.weight_scale    F8_E4M3 [N, K/16]  one scale per 16 values of a row
    <module>.weight_scale_2  F32 []             per-tensor scale: x = E2M1[q] * (float32(weight_scale) * weight_scale_2)
    <module>.input_scale     F32 []             the activations' global scale (not used)
-> surojax.quant.NVFP4(data = weight, scale = weight_scale, global_scale = weight_scale_2): the same arrays and the
same arithmetic as ModelOpt's NVFP4QTensor.dequantize, so the values agree bit for bit in float32.

quant_algo "FP8" (per-tensor W8A8):
    <module>.weight F8_E4M3 [N, K], <module>.weight_scale F32 [] (x = weight * weight_scale), input_scale
-> surojax.quant.FP8Block with one scale for the tensor (block (N, K)).

An FP8 KV cache (hf_quant_config.json's kv_cache_quant_algo "FP8"; config.json's kv_cache_scheme {"num_bits": 8,
"type": "float", ...} or "FP8" in the exports ModelOpt converts to the compressed-tensors layout): the attention
layers' k_proj.k_scale / v_proj.v_scale are not used (the KV cache stays in the compute dtype). Which modules are
quantised comes from the tensors (exclude_modules / ignore are stored in float).
Refused, naming the key: other quant_algo values (W4A16_AWQ, W4A8_AWQ, NVFP4_AWQ, MXFP8, MIXED_PRECISION, ...), an
NVFP4 group_size other than 16.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from surojax.quant.base import QuantFormat
from surojax.quant.nvfp4 import BLOCK, NVFP4
from surojax.weights.prequant.base import (Claims, PrequantError, QuantScheme, Stored, expect_shape, kv_cache_scales,
                                           refuse_unclaimed, scalar, tensor, with_suffix)
from surojax.weights.prequant.fp8_blocks import E4M3, fp8_weight

ALGOS = {"NVFP4": "nvfp4", "FP8": "fp8"}
FP8_KV = {"num_bits": 8, "type": "float"}  # kv_cache_scheme of an FP8 KV cache (modelopt convert_hf_config)


class ModelOpt(QuantScheme):
    method = "modelopt"

    def __init__(self, source: Path, algo: str, kv_cache: bool):
        self.source, self.algo, self.kv_cache = source, algo, kv_cache
        self.format = ALGOS.get(algo, "")

    @classmethod
    def from_config(cls, config: dict, source: Path) -> "ModelOpt":
        """config: config.json's quantization_config, or hf_quant_config.json's "quantization" object."""
        algo = config.get("quant_algo")
        self = cls(source, algo, False)
        if algo not in ALGOS:
            raise self.config_error("quant_algo", f"one of {', '.join(ALGOS)}", algo)
        kv = self._fp8_kv_cache(config)
        if algo == "NVFP4":
            size = config.get("group_size", BLOCK)
            for name, group in (config.get("config_groups") or {}).items():
                size = (group.get("weights") or {}).get("group_size", size)
            if size != BLOCK:
                raise self.config_error("group_size", f"{BLOCK} (NVFP4 scales 16 values each)", size)
        return cls(source, algo, kv)

    def _fp8_kv_cache(self, config: dict) -> bool:
        """Whether the export has an FP8 KV cache (its k_scale / v_scale tensors): hf_quant_config.json's
        kv_cache_quant_algo, or config.json's kv_cache_scheme; another KV cache format is refused."""
        algo, scheme = config.get("kv_cache_quant_algo"), config.get("kv_cache_scheme")
        if algo not in (None, "FP8"):
            raise self.config_error("kv_cache_quant_algo", "null or \"FP8\"", algo)
        if scheme is not None and scheme != "FP8" and not (
                isinstance(scheme, dict) and all(scheme.get(k) == v for k, v in FP8_KV.items())):
            raise self.config_error("kv_cache_scheme", "null, \"FP8\" or {\"num_bits\": 8, \"type\": \"float\"}",
                                    scheme)
        return algo is not None or scheme is not None

    def describe(self) -> str:
        return f"modelopt {self.algo} -> surojax {self.format}"

    def claim(self, where: dict) -> Claims:
        weights = {}
        marker = ".weight_scale_2" if self.algo == "NVFP4" else ".weight_scale"
        for module in with_suffix(where, marker):
            weight = f"{module}.weight"
            parts = {"scale": f"{module}.weight_scale"}
            if self.algo == "NVFP4":
                parts["scale_2"] = f"{module}.weight_scale_2"
            for name in (weight, *parts.values()):
                if name not in where:
                    raise PrequantError(f"{where[module + marker].path}: tensor {module + marker} has no {name} "
                                        f"(ModelOpt {self.algo} stores {', '.join([weight, *parts.values()])})")
            unused = (f"{module}.input_scale",) if f"{module}.input_scale" in where else ()
            weights[weight] = Stored(weight, parts, unused)
        refuse_unclaimed(where, weights, (E4M3, np.dtype(np.uint8)),
                         f"ModelOpt {self.algo} stores <module>.weight with <module>{marker}")
        return Claims(weights, kv_cache_scales(where) if self.kv_cache else ())

    def logical_shape(self, stored: Stored, where: dict) -> tuple[int, int]:
        n, k = where[stored.weight].shape(stored.weight)[:2]
        return (n, 2 * k) if self.algo == "NVFP4" else (n, k)

    def read(self, stored: Stored, where: dict) -> QuantFormat:
        if self.algo == "FP8":
            return fp8_weight(where, stored, None, f"{self.source.name}: ModelOpt FP8")
        data = tensor(where, stored.weight, (np.uint8,), ndim=2)
        n, k = data.shape[0], 2 * data.shape[1]
        if k % BLOCK:
            raise PrequantError(f"{where[stored.weight].path}: tensor {stored.weight} has shape {list(data.shape)}: "
                                f"{k} values per row, expected a multiple of {BLOCK} (NVFP4 blocks)")
        scale = tensor(where, stored.parts["scale"], (E4M3,))
        expect_shape(where, stored.parts["scale"], scale, [(n, k // BLOCK)], f"one E4M3 scale per {BLOCK} values")
        global_scale = scalar(where, stored.parts["scale_2"], (np.float32,))
        return NVFP4(data=data, scale=scale, global_scale=np.asarray(global_scale, np.float32), shape=(k, n))
