"""GGUFMixed: one stacked weight [L, K, N] whose layers have different GGUF types, kept quantised.

llama.cpp's mixed file types give a projection different types on different layers (Q4_K_M: attn_v and ffn_down
in Q6_K where `use_more_bits(layer)`, Q4_K elsewhere). The decoder scans over a stacked weight, so one pytree
must hold every layer with the same leaf shapes. GGUFMixed stores each layer's rows in its own type's block
bytes, right-padded with zeros to the longest row among the types present:

    data  uint8 [..., N, R]   R = max over `types` of K / block_size * type_size
    kind  int32 [...]         index into `types` for each layer (the scan slices it with `data`)
    types tuple[str]          static: GGUF format names, e.g. ("q4_k", "q6_k")
    shape (K, N)              static, as for every format

`dequantize` decodes one layer with `lax.switch(kind, ...)` over the types' decoders (vmapped over leading
layer axes), so a layer's values are bit-identical to its own format's `dequantize`. The padding costs memory
on the narrower layers (a Q4_K row padded to Q6_K's length: 6.56 bits per weight, still far below bf16); the
matmul is the reference dequantise-then-XLA path. Built from files only (`from_layers`); there is no quantiser.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from surojax.quant.base import FORMATS, QuantFormat, register_format, static
from surojax.quant.gguf_base import GGUFQuant


@register_format("gguf_mixed")
class GGUFMixed(QuantFormat):
    data: jax.Array
    kind: jax.Array
    shape: tuple[int, int] = static()
    types: tuple[str, ...] = static()

    @classmethod
    def quantize(cls, w, **kw):
        raise NotImplementedError("gguf_mixed is built from GGUF files (GGUFMixed.from_layers), not quantised")

    @classmethod
    def row_bytes(cls, name: str, k: int) -> int:
        f = FORMATS[name]
        return k // f.block_size * f.type_size * np.dtype(f.storage_dtype).itemsize

    @classmethod
    def from_layers(cls, layers: Sequence[GGUFQuant]) -> "GGUFMixed":
        """Stack single-layer GGUF weights of any types (same (K, N)) along a new leading layers axis."""
        shapes = {w.shape for w in layers}
        if len(shapes) != 1:
            raise ValueError(f"gguf_mixed: layers have different shapes {sorted(shapes)}")
        (k, n), = shapes
        types = tuple(sorted({w.name for w in layers}))
        width = max(cls.row_bytes(t, k) for t in types)
        data = np.zeros((len(layers), n, width), np.uint8)
        for i, w in enumerate(layers):
            raw = np.asarray(w.data).view(np.uint8).reshape(n, -1)
            data[i, :, :raw.shape[1]] = raw
        kind = np.asarray([types.index(w.name) for w in layers], np.int32)
        return cls(data=jnp.asarray(data), kind=jnp.asarray(kind), shape=(k, n), types=types)

    def layer(self, i: int) -> GGUFQuant:
        """Layer i (of a stacked weight) as its own GGUF format."""
        name = self.types[int(self.kind[i])]
        f = FORMATS[name]
        raw = np.asarray(self.data[i])[:, :self.row_bytes(name, self.shape[0])]
        return f.from_gguf(np.ascontiguousarray(raw), *self.shape)

    def typed(self, name: str, data: jax.Array) -> GGUFQuant:
        """Rows of layers of type `name` (data [..., N, R], this stack's padded bytes) as that format's weight
        (padding cut off, the bytes read in its storage dtype)."""
        f = FORMATS[name]
        raw = data[..., :self.row_bytes(name, self.shape[0])]
        if f.storage_dtype != np.uint8:
            size = np.dtype(f.storage_dtype).itemsize
            raw = jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, size), f.storage_dtype)
        return f(data=raw, shape=self.shape)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        branches = [lambda data, t=t: self.typed(t, data).dequantize(dtype) for t in self.types]

        def one(data, kind):  # data [N, R], kind [] -> [K, N]
            return jax.lax.switch(kind, branches, data)

        fn = one
        for _ in range(jnp.ndim(self.kind)):
            fn = jax.vmap(fn)
        return fn(jnp.asarray(self.data), jnp.asarray(self.kind))
