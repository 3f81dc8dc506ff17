"""Pre-quantised Hugging Face checkpoints: the checkpoint's quantization_config picks a reader (a `QuantScheme`,
surojax.weights.prequant.base) that turns each quantised Linear's stored tensors into surojax's matching
quantised-weight pytree without a dequantise-requantise round trip.

    scheme = read_scheme(model_dir)      # None for a float checkpoint; PrequantError for one surojax cannot read
    where, unused = with_prequant(open_checkpoint(model_dir), scheme)   # what hf_checkpoint.load_model does

quant_method (config.json quantization_config, or compression_config in older compressed-tensors exports, or
ModelOpt's hf_quant_config.json) -> reader -> surojax format:

    "fp8"                 fp8_blocks.FineGrainedFP8         transformers / DeepSeek / Qwen3-FP8 block scales   fp8
    "compressed-tensors"  compressed_tensors.CompressedTensors  float-quantized FP8 (tensor / channel / group /
                                                            block scales)                                     fp8
    "modelopt"            modelopt.ModelOpt                 NVFP4 (and per-tensor FP8) exports                 nvfp4
    "bitsandbytes"        bnb_nf4.BitsAndBytesNF4           4-bit NF4 exports, double quantisation             nf4
    "mxfp4"               (gpt-oss experts: surojax.weights.mxfp4_checkpoint, not through this seam)

Anything else is refused naming the file, the key and the list above.
"""
from __future__ import annotations

import os
from pathlib import Path

from surojax.weights.json_file import read_json_object
from surojax.weights.prequant.base import PrequantError, PrequantTensor, QuantScheme, with_prequant
from surojax.weights.prequant.bnb_nf4 import BitsAndBytesNF4
from surojax.weights.prequant.compressed_tensors import CompressedTensors
from surojax.weights.prequant.fp8_blocks import FineGrainedFP8
from surojax.weights.prequant.modelopt import ModelOpt

READERS: dict[str, type[QuantScheme]] = {cls.method: cls for cls in
                                         (FineGrainedFP8, CompressedTensors, ModelOpt, BitsAndBytesNF4)}
ELSEWHERE = {"mxfp4": "gpt-oss MXFP4 experts (surojax.weights.mxfp4_checkpoint)"}
HF_QUANT_CONFIG = "hf_quant_config.json"
LEGACY_KEY = "compression_config"  # older compressed-tensors exports' name for it (vLLM and compressed-tensors read it)


def _supported() -> str:
    return ", ".join([*READERS, *ELSEWHERE])


def read_scheme(model_dir: str | os.PathLike) -> QuantScheme | None:
    """The reader of the checkpoint in `model_dir`: from config.json's quantization_config (or compression_config,
    as older compressed-tensors exports call it), else from ModelOpt's hf_quant_config.json; None when none says the
    weights are quantised (or for mxfp4, read elsewhere)."""
    d = Path(model_dir)
    config_path = d / "config.json"
    hf = read_json_object(config_path, PrequantError) if config_path.is_file() else {}
    config = hf.get("quantization_config", hf.get(LEGACY_KEY))
    source = config_path
    if config is None and (d / HF_QUANT_CONFIG).is_file():
        source = d / HF_QUANT_CONFIG
        hf_quant = read_json_object(source, PrequantError)
        config = hf_quant.get("quantization")
        if not isinstance(config, dict):
            raise PrequantError(f"{source}: expected a \"quantization\" object (ModelOpt's export), found "
                                f"{config!r}")
        config = {"quant_method": "modelopt", **config}
    if config is None:
        return None
    if not isinstance(config, dict):
        raise PrequantError(f"{source}: quantization_config: expected an object, found {config!r}")
    method = config.get("quant_method")
    if method in ELSEWHERE:
        return None
    if method not in READERS:
        raise PrequantError(f"{source}: quantization_config.quant_method: {method!r} is not supported; surojax "
                            f"loads pre-quantised checkpoints of quant_method {_supported()}")
    return READERS[method].from_config(config, source)


__all__ = ["PrequantError", "PrequantTensor", "QuantScheme", "READERS", "read_scheme", "with_prequant"]
