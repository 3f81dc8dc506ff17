"""The interface of a pre-quantised checkpoint reader, and the virtual tensor that stands for one quantised weight
in the loader's tensor name -> file map.

A reader is a `QuantScheme`, made from the checkpoint's quantization_config (surojax.weights.prequant picks the
class by quant_method). It knows its format's tensors and does three things:

    scheme.claim(where) -> Claims        which weights are quantised, and every tensor that stores them (scales),
                                         plus tensors of the format it does not use (activation / KV-cache scales)
    scheme.logical_shape(stored, where)  the [out, in] shape of one quantised weight (what the config implies)
    scheme.read(stored, where)           that weight as surojax's matching format (surojax.quant: FP8Block,
                                         NVFP4, NF4), logical [in, out] = [K, N], its arrays as stored

`read` moves bytes and widens scales exactly (bf16 / fp16 -> fp32); it never rounds a value. Where a stored layout
and the surojax format differ, the reader converts exactly or refuses naming what it found.

`with_prequant(where, scheme)` gives the loader a map in which each quantised weight is one `PrequantTensor` under
its plain name (`<module>.weight`) and its scales are gone: shape and name checks run as for a float checkpoint,
`get` returns the dequantised float32 [out, in] (what a dequantised load and non-Linear rows use) and
`quantized()` the format pytree (what a kept-quantised load stacks over layers).

Activations: every format here is loaded weight-only. A checkpoint's activation scales (input_scale,
activation_scale) and KV-cache scales (k_scale, v_scale) are checked to be where the format puts them and are not
used: activations and the KV cache stay in the run's compute dtype, as transformers runs these checkpoints when it
dequantises them. The loader logs which tensors those are.
"""
from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from surojax.quant.base import QuantFormat
from surojax.weights.safetensors_file import WeightsError

FLOAT_SCALES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


class PrequantError(WeightsError):
    """A pre-quantised checkpoint surojax cannot read: the message names the file, the tensor or config key, and
    what was expected vs found."""


@dataclasses.dataclass(frozen=True)
class Stored:
    """One quantised weight as the checkpoint stores it: its name (`<module>.weight`), the other tensors that hold
    it (role -> tensor name, e.g. {"scale": "<module>.weight_scale_inv"}), and tensors it holds that are not used."""

    weight: str
    parts: dict[str, str]
    unused: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.weight.rsplit(".", 1)[0]


@dataclasses.dataclass(frozen=True)
class Claims:
    """What a scheme claims in a checkpoint: each quantised weight, and tensors that belong to no weight but to the
    format (KV-cache scales), not used."""

    weights: dict[str, Stored]
    unused: tuple[str, ...] = ()


class QuantScheme(abc.ABC):
    """One checkpoint quantisation scheme (module docstring). Subclasses set `method` (the quant_method they read)
    and `format` (the surojax.quant format their weights become), and are built by `from_config`."""

    method: ClassVar[str]
    format: str
    source: Path  # the file its config came from (config.json or hf_quant_config.json)

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: dict, source: Path) -> "QuantScheme":
        """The scheme of a quantization_config dict (read from `source`); PrequantError for what it cannot read."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for logs: the tool's scheme and the surojax format it becomes."""

    @abc.abstractmethod
    def claim(self, where: dict) -> Claims:
        """The quantised weights among the tensors of `where` (name -> file); PrequantError for a tensor of the
        format that is incomplete (a scale without its weight, a quantised weight without its scale)."""

    def logical_shape(self, stored: Stored, where: dict) -> tuple[int, int]:
        """(out, in) of the weight, as a float checkpoint would store it: the stored weight's shape, for formats
        that store one value per element (a packed format overrides it)."""
        return tuple(where[stored.weight].shape(stored.weight))

    @abc.abstractmethod
    def read(self, stored: Stored, where: dict) -> QuantFormat:
        """The weight as surojax's format ([K, N] logical, arrays numpy, as stored); PrequantError naming the
        tensor for a dtype or shape the format does not have."""

    def config_error(self, key: str, expected: str, found) -> PrequantError:
        return PrequantError(f"{self.source}: quantization_config.{key}: expected {expected}, found {found!r}")


# -- helpers the readers share ----------------------------------------------------------------------------------
def tensor(where: dict, name: str, dtypes: tuple, ndim: int | tuple[int, ...] | None = None) -> np.ndarray:
    """`name` read from its file, checked to have one of `dtypes` (numpy dtypes) and `ndim` dimensions."""
    f = where[name]
    dtype = np.dtype(f.dtype(name))
    if dtype not in dtypes:
        raise PrequantError(f"{f.path}: tensor {name} has dtype {dtype}, expected "
                            f"{' or '.join(str(np.dtype(d)) for d in dtypes)}")
    arr = f.get(name)
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if dims is not None and arr.ndim not in dims:
        raise PrequantError(f"{f.path}: tensor {name} has shape {list(arr.shape)}, expected "
                            f"{' or '.join(f'{d} dimensions' for d in dims)}")
    return arr


def expect_shape(where: dict, name: str, arr: np.ndarray, shapes: list[tuple[int, ...]], what: str) -> None:
    """PrequantError unless arr's shape is one of `shapes` (`what` says what the shape follows from)."""
    if tuple(arr.shape) not in [tuple(s) for s in shapes]:
        want = " or ".join(str(list(s)) for s in shapes)
        raise PrequantError(f"{where[name].path}: tensor {name} has shape {list(arr.shape)}, expected {want} "
                            f"({what})")


def scalar(where: dict, name: str, dtypes: tuple = FLOAT_SCALES) -> np.float32:
    """A one-value tensor (shape [], [1] or [1, 1]) as float32 (widened exactly), checked finite and positive."""
    arr = tensor(where, name, dtypes)
    expect_shape(where, name, arr, [(), (1,), (1, 1)], "one value per tensor")
    value = np.float32(arr.reshape(()).astype(np.float32))
    if not (np.isfinite(value) and value > 0):
        raise PrequantError(f"{where[name].path}: tensor {name} is {value}, expected a finite positive scale")
    return value


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def refuse_unclaimed(where: dict, weights: dict[str, Stored], dtypes: tuple, what: str) -> None:
    """PrequantError for a tensor of a quantised dtype (`dtypes`) that no claimed weight stores (`what` says what a
    quantised weight needs next to it)."""
    claimed = {n for s in weights.values() for n in (s.weight, *s.parts.values(), *s.unused)}
    for name, f in where.items():
        if name not in claimed and np.dtype(f.dtype(name)) in dtypes:
            raise PrequantError(f"{f.path}: tensor {name} is {np.dtype(f.dtype(name))} but is not a quantised weight "
                                f"this checkpoint describes ({what})")


def kv_cache_scales(where: dict) -> tuple[str, ...]:
    """The KV-cache scale tensors (<attention>.k_scale / v_scale) of a checkpoint with a quantised KV cache (not
    used: module docstring)."""
    return tuple(n for n in where if n.endswith((".k_scale", ".v_scale")))


def with_suffix(names, suffix: str) -> list[str]:
    """The module names (`name` minus `suffix`) of the tensors named `<module><suffix>`."""
    return [n[: -len(suffix)] for n in names if n.endswith(suffix)]


class PrequantTensor:
    """A quantised weight standing as one float tensor in the loader's name -> file map (the `SafetensorsFile`
    reading interface: path, shape, dtype, get), with `quantized()` for the format pytree."""

    def __init__(self, scheme: QuantScheme, stored: Stored, where: dict):
        self.scheme, self.stored, self.where = scheme, stored, where
        self.path = Path(where[stored.weight].path)

    def shape(self, name: str) -> tuple[int, int]:
        return self.scheme.logical_shape(self.stored, self.where)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32)

    def quantized(self) -> QuantFormat:
        return self.scheme.read(self.stored, self.where)

    def get(self, name: str) -> np.ndarray:
        """The dequantised weight, float32 [out, in] (the format's own dequantize, transposed back)."""
        return np.ascontiguousarray(np.asarray(_dequantize_f32(self.quantized())).T)


@jax.jit
def _dequantize_f32(q: QuantFormat) -> jax.Array:
    return q.dequantize(jnp.float32)  # one compiled program per format and shape, not one dispatch per operation


def with_prequant(where: dict, scheme: QuantScheme) -> tuple[dict, tuple[str, ...]]:
    """(`where` with each quantised weight one PrequantTensor and its scales gone, the claimed tensors not used)."""
    claims = scheme.claim(where)
    out = dict(where)
    unused = list(claims.unused)
    for name, stored in claims.weights.items():
        for part in (*stored.parts.values(), *stored.unused):
            out.pop(part, None)
        unused += stored.unused
        out[name] = PrequantTensor(scheme, stored, where)
    for name in claims.unused:
        out.pop(name, None)
    return out, tuple(sorted(unused))
