"""FP8 checkpoints in the compressed-tensors format (quant_method "compressed-tensors", format "float-quantized", as
llm-compressor writes them and vLLM / transformers read them: RedHatAI/*-FP8-dynamic, *-FP8, neuralmagic/*):

    config.json  quantization_config: {"quant_method": "compressed-tensors", "format": "float-quantized",
                 "quantization_status": "compressed", "config_groups": {name: {"targets": [...], "weights": {
                 "num_bits": 8, "type": "float", "symmetric": true, "strategy": ..., ...}, "input_activations":
                 ...}}, "ignore": [...], "kv_cache_scheme": ...}
    <module>.weight        F8_E4M3 [N, K]
    <module>.weight_scale  BF16 / F32, by the group's weights.strategy:
                             "tensor"  [1] (or [])                      -> FP8Block block (N, K), scale [1, 1]
                             "channel" [N, 1]                           -> block (1, K)
                             "group"   [N, ceil(K/g)] (group_size g)    -> block (1, g)
                             "block"   [ceil(N/bn), ceil(K/bk)] (block_structure [bn, bk]; partial blocks padded
                                        as compressed-tensors pads)   -> block (bn, bk)
    <module>.input_scale   static input activations (not used: the weight only runs)
    <layer>.k_scale / v_scale  with a kv_cache_scheme (not used)

Every strategy is an FP8Block block shape, so the stored arrays load as they are (scales widened to fp32
exactly) and dequantisation is compressed-tensors' `dequantize` (weight * scale) computed in float32; rounded to
bf16 it is the decompressed bf16 weight bit for bit (the fp32 product is exact, both round it once).

A module's group is the first config group whose targets match its name as compressed-tensors matches them
("re:<regex>" with re.match, "Linear" for every linear layer, else the exact name); a module with a weight_scale
that no group targets, or that `ignore` lists, is an error. Refused, naming the key: weights that are not 8-bit
symmetric floats (int8 "int-quantized", W4A16 "pack-quantized", NVFP4 "nvfp4-pack-quantized", zero points),
dynamic weights, a non-empty transform_config (rotations) or sparsity_config, and quantization_status other than
"compressed" or "frozen" (older "naive-quantized" exports such as nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf,
transformers' documented example, say "frozen" and store the same FP8 tensors; a weight not stored in E4M3 is
refused naming it). Older exports name the whole object compression_config (surojax.weights.prequant reads it).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from surojax.quant.fp8 import FP8Block
from surojax.weights.prequant.base import (Claims, PrequantError, QuantScheme, Stored, kv_cache_scales,
                                           refuse_unclaimed, with_suffix)
from surojax.weights.prequant.fp8_blocks import E4M3, fp8_weight

FORMATS = ("float-quantized", "naive-quantized")  # the same tensors for 8-bit float weights
STATUSES = ("compressed", "frozen")  # frozen: older naive-quantized exports, their weights stored in FP8 all the same
STRATEGIES = ("tensor", "channel", "group", "block")
SCALE = ".weight_scale"


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    targets: tuple[str, ...]
    strategy: str
    block: tuple[int, int] | None  # "block": block_structure; "group": (1, group_size); else set per weight
    static_input: bool

    def block_of(self, n: int, k: int) -> tuple[int, int] | None:
        """The FP8Block block of an [n, k] weight (None: one scale per tensor)."""
        return {"tensor": None, "channel": (1, k)}.get(self.strategy, self.block)


def matches(module: str, target: str) -> bool:
    """compressed-tensors' match of a target against a Linear module's name (utils.match.match_name / class)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


class CompressedTensors(QuantScheme):
    method = "compressed-tensors"
    format = "fp8"

    def __init__(self, source: Path, groups: tuple[Group, ...], ignore: tuple[str, ...], kv_cache: bool):
        self.source, self.groups, self.ignore, self.kv_cache = source, groups, ignore, kv_cache

    @classmethod
    def from_config(cls, config: dict, source: Path) -> "CompressedTensors":
        self = cls(source, (), (), False)
        status = config.get("quantization_status", "compressed")
        if status not in STATUSES:
            raise self.config_error("quantization_status", "\"compressed\" or \"frozen\" (weights stored quantised)",
                                    status)
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise self.config_error(key, "empty (surojax reads dense weights without transforms)",
                                        config.get(key))
        top_format = config.get("format")
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise self.config_error("config_groups", "a non-empty object of quantisation groups", groups)
        parsed = tuple(self._group(name, g, top_format) for name, g in groups.items())
        ignore = config.get("ignore") or []
        if not (isinstance(ignore, list) and all(isinstance(t, str) for t in ignore)):
            raise self.config_error("ignore", "a list of module names or \"re:\" patterns", ignore)
        return cls(source, parsed, tuple(ignore), bool(config.get("kv_cache_scheme")))

    def _group(self, name: str, group: dict, top_format) -> Group:
        key = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise self.config_error(key, "an object", group)
        fmt = group.get("format") or top_format
        if fmt not in FORMATS:
            raise self.config_error(f"{key}.format", f"one of {', '.join(FORMATS)} (8-bit float weights; other "
                                    "compressed-tensors formats are not supported)", fmt)
        w = group.get("weights")
        if not isinstance(w, dict):
            raise self.config_error(f"{key}.weights", "an object (weight quantisation)", w)
        want = {"num_bits": 8, "type": "float", "symmetric": True}
        for k, v in want.items():
            if w.get(k, v) != v:
                raise self.config_error(f"{key}.weights.{k}", f"{v!r} (FP8 E4M3 weights)", w.get(k))
        if w.get("dynamic", False):
            raise self.config_error(f"{key}.weights.dynamic", "false (weights stored quantised)", w.get("dynamic"))
        strategy = w.get("strategy")
        if strategy not in STRATEGIES:
            raise self.config_error(f"{key}.weights.strategy", f"one of {', '.join(STRATEGIES)}", strategy)
        block = None
        if strategy == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, list) and len(bs) == 2 and all(type(b) is int and b > 0 for b in bs)):
                raise self.config_error(f"{key}.weights.block_structure", "two positive integers", bs)
            block = (bs[0], bs[1])
        elif strategy == "group":
            g = w.get("group_size")
            if not (type(g) is int and g > 0):
                raise self.config_error(f"{key}.weights.group_size", "a positive integer", g)
            block = (1, g)
        if group.get("output_activations"):
            raise self.config_error(f"{key}.output_activations", "null", group.get("output_activations"))
        targets = group.get("targets")
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
            raise self.config_error(f"{key}.targets", "a list of module names, \"re:\" patterns or \"Linear\"",
                                    targets)
        inputs = group.get("input_activations")
        return Group(name, tuple(targets), strategy, block, bool(inputs) and not inputs.get("dynamic", False))

    def describe(self) -> str:
        kinds = ", ".join(f"{g.name}: {g.strategy}" + (f" {g.block[0]}x{g.block[1]}" if g.strategy == "block" else "")
                          for g in self.groups)
        return f"compressed-tensors float-quantized FP8 ({kinds}) -> surojax fp8"

    def group_of(self, module: str) -> Group | None:
        return next((g for g in self.groups if any(matches(module, t) for t in g.targets)), None)

    def claim(self, where: dict) -> Claims:
        weights = {}
        for module in with_suffix(where, SCALE):
            path = where[module + SCALE].path
            weight = f"{module}.weight"
            if weight not in where:
                raise PrequantError(f"{path}: tensor {module + SCALE} has no {weight}")
            if f"{module}.weight_zero_point" in where:
                raise PrequantError(f"{path}: tensor {module}.weight_zero_point: asymmetric weights are not "
                                    "supported (symmetric FP8 only)")
            group = self.group_of(module)
            ignored = any(matches(module, t) for t in self.ignore if t != "Linear")
            if group is None or ignored:
                why = f"is in `ignore` {list(self.ignore)}" if ignored else \
                    f"is targeted by no config group ({', '.join(f'{g.name}: {list(g.targets)}' for g in self.groups)})"
                raise PrequantError(f"{path}: tensor {module + SCALE}: module {module} {why} in {self.source}")
            unused = (f"{module}.input_scale",) if f"{module}.input_scale" in where else ()
            if group.static_input and not unused:
                raise PrequantError(f"{path}: module {module} has no {module}.input_scale ({self.source}: group "
                                    f"{group.name} has static input activations)")
            weights[weight] = Stored(weight, {"scale": module + SCALE}, unused)
        refuse_unclaimed(where, weights, (E4M3,), f"compressed-tensors stores <module>.weight with <module>{SCALE}")
        return Claims(weights, kv_cache_scales(where) if self.kv_cache else ())

    def read(self, stored: Stored, where: dict) -> FP8Block:
        group = self.group_of(stored.module)
        n, k = self.logical_shape(stored, where)
        return fp8_weight(where, stored, group.block_of(n, k),
                          f"{self.source.name}: compressed-tensors group {group.name}, strategy {group.strategy}")
