"""bitsandbytes 4-bit NF4 exports (quant_method "bitsandbytes": a model loaded with BitsAndBytesConfig(load_in_4bit,
bnb_4bit_quant_type="nf4") and saved with save_pretrained: unsloth/*-bnb-4bit, *-nf4). Each Linear4bit writes
`QuantState.as_dict(packed=True)` next to its weight:

    <module>.weight                      [N*K/2, 1] in the quant storage dtype (uint8 by default; bf16 / fp16 /
                                         fp32 with bnb_4bit_quant_storage): the packed NF4 bytes, read as bytes
    <module>.weight.quant_map            F32 [16]  the NF4 code book
    <module>.weight.absmax               F32 [N*K/64], or U8 (double quantisation) codes of absmax - offset
    <module>.weight.nested_absmax        F32 [ceil(nb/256)]   (double quantisation) scale of each 256 codes
    <module>.weight.nested_quant_map     F32 [256]            (double quantisation) the 8-bit dynamic code book
    <module>.weight.quant_state.bitsandbytes__nf4   U8: JSON {"quant_type": "nf4", "blocksize": 64, "dtype",
                                         "shape": [N, K], "nested_blocksize": 256, "nested_dtype": "float32",
                                         "nested_offset": offset}

-> surojax.quant.NF4: the same layout (data = the bytes, first value of a byte in its HIGH nibble; absmax, or
absmax_q / absmax_scale / absmax_offset / absmax_code for double quantisation), so nothing is converted and
dequantisation is bitsandbytes' dequantize_4bit computed in float32 (code[q] * absmax, absmax = code2[a] *
nested_absmax + offset) bit for bit. Which modules are quantised comes from the tensors (llm_int8_skip_modules are
stored in float). Refused, naming the key or tensor: 8-bit exports (load_in_8bit: LLM.int8 `SCB`), FP4
(bnb_4bit_quant_type "fp4"), block sizes other than 64 / 256, a quant_map that is not NF4.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from surojax.quant.nf4 import BLOCK, DQ_BLOCK, NF4, NF4_CODE
from surojax.weights.prequant.base import (Claims, PrequantError, QuantScheme, Stored, cdiv, expect_shape,
                                           refuse_unclaimed, tensor, with_suffix)

STATE = ".quant_state.bitsandbytes__nf4"
FP4_STATE = ".quant_state.bitsandbytes__fp4"
F32 = (np.dtype(np.float32),)


class BitsAndBytesNF4(QuantScheme):
    method = "bitsandbytes"
    format = "nf4"

    def __init__(self, source: Path, double_quant: bool = False):
        self.source, self.double_quant = source, double_quant  # config.json's bnb_4bit_use_double_quant

    @classmethod
    def from_config(cls, config: dict, source: Path) -> "BitsAndBytesNF4":
        self = cls(source)
        if config.get("load_in_8bit"):
            raise self.config_error("load_in_8bit", "false (8-bit LLM.int8 exports are not supported; 4-bit NF4 "
                                    "exports are)", config.get("load_in_8bit"))
        if not config.get("load_in_4bit", config.get("_load_in_4bit")):
            raise self.config_error("load_in_4bit", "true", config.get("load_in_4bit"))
        kind = config.get("bnb_4bit_quant_type", "fp4")  # bitsandbytes' own default
        if kind != "nf4":
            raise self.config_error("bnb_4bit_quant_type", "\"nf4\" (FP4 exports are not supported)", kind)
        return cls(source, bool(config.get("bnb_4bit_use_double_quant", False)))

    def describe(self) -> str:
        return "bitsandbytes 4-bit NF4 (blocks of 64, double quantisation where stored) -> surojax nf4"

    def claim(self, where: dict) -> Claims:
        weights = {}
        for weight in with_suffix(where, FP4_STATE):
            raise PrequantError(f"{where[weight + FP4_STATE].path}: tensor {weight + FP4_STATE}: FP4 weights are "
                                "not supported (NF4 are)")
        for weight in with_suffix(where, STATE):
            parts = {"state": weight + STATE, "quant_map": weight + ".quant_map", "absmax": weight + ".absmax"}
            if weight + ".nested_absmax" in where:
                parts.update(nested_absmax=weight + ".nested_absmax", nested_quant_map=weight + ".nested_quant_map")
            for name in (weight, *parts.values()):
                if name not in where:
                    raise PrequantError(f"{where[weight + STATE].path}: tensor {weight + STATE} has no {name} "
                                        f"(bitsandbytes stores {', '.join([weight, *parts.values()])})")
            weights[weight] = Stored(weight, parts)
        refuse_unclaimed(where, weights, (np.dtype(np.uint8),),
                         f"bitsandbytes stores <module>.weight with <module>.weight{STATE}")
        return Claims(weights)

    def _state(self, stored: Stored, where: dict) -> dict:
        name = stored.parts["state"]
        path = where[name].path
        raw = tensor(where, name, (np.uint8,), ndim=1)
        try:
            state = json.loads(raw.tobytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PrequantError(f"{path}: tensor {name}: expected bitsandbytes' packed JSON quant state ({e})") \
                from None
        nested = "nested_absmax" in stored.parts
        want = {"quant_type": "nf4", "blocksize": BLOCK}
        if nested:
            want.update(nested_blocksize=DQ_BLOCK, nested_dtype="float32")
        for key, value in want.items():
            if state.get(key) != value:
                raise PrequantError(f"{path}: tensor {name}: {key} is {state.get(key)!r}, expected {value!r}")
        shape = state.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d > 0 for d in shape)):
            raise PrequantError(f"{path}: tensor {name}: shape is {shape!r}, expected [out, in]")
        if nested and not isinstance(state.get("nested_offset"), (int, float)):
            raise PrequantError(f"{path}: tensor {name}: nested_offset is {state.get('nested_offset')!r}, "
                                "expected a number")
        return state

    def logical_shape(self, stored: Stored, where: dict) -> tuple[int, int]:
        n, k = self._state(stored, where)["shape"]
        return n, k

    def read(self, stored: Stored, where: dict) -> NF4:
        state = self._state(stored, where)
        n, k = state["shape"]
        path = where[stored.weight].path
        if (n * k) % BLOCK:
            raise PrequantError(f"{path}: tensor {stored.weight}: {n} x {k} values are not whole blocks of {BLOCK}")
        f = where[stored.weight]
        data = np.ascontiguousarray(f.get(stored.weight)).reshape(-1).view(np.uint8)  # the bytes, any storage dtype
        if data.size != n * k // 2:
            raise PrequantError(f"{path}: tensor {stored.weight} holds {data.size} bytes, expected {n * k // 2} "
                                f"(two NF4 codes per byte of a [{n}, {k}] weight)")
        code = tensor(where, stored.parts["quant_map"], F32, ndim=1)
        if code.shape != (16,) or not np.array_equal(code.view(np.uint32), NF4_CODE.view(np.uint32)):
            raise PrequantError(f"{path}: tensor {stored.parts['quant_map']} is not bitsandbytes' NF4 code book")
        blocks = n * k // BLOCK
        if "nested_absmax" not in stored.parts:
            absmax = tensor(where, stored.parts["absmax"], F32, ndim=1)
            expect_shape(where, stored.parts["absmax"], absmax, [(blocks,)], f"one absmax per {BLOCK} values")
            return NF4(data=data, absmax=absmax, shape=(k, n))
        absmax_q = tensor(where, stored.parts["absmax"], (np.dtype(np.uint8),), ndim=1)
        expect_shape(where, stored.parts["absmax"], absmax_q, [(blocks,)], f"one 8-bit absmax code per {BLOCK} values")
        scale = tensor(where, stored.parts["nested_absmax"], F32, ndim=1)
        expect_shape(where, stored.parts["nested_absmax"], scale, [(cdiv(blocks, DQ_BLOCK),)],
                     f"one scale per {DQ_BLOCK} absmax codes")
        code2 = tensor(where, stored.parts["nested_quant_map"], F32, ndim=1)
        expect_shape(where, stored.parts["nested_quant_map"], code2, [(256,)], "the 8-bit code book")
        return NF4(data=data, absmax_q=absmax_q, absmax_scale=scale,
                   absmax_offset=np.asarray(state["nested_offset"], np.float32), absmax_code=code2, shape=(k, n),
                   double_quant=True)
