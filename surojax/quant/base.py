"""The base of every weight format: a registered JAX pytree dataclass with quantize / dequantize / matmul.

Shape legend (local to surojax.quant, the GEMM convention): a linear kernel is stored [in, out] = [K, N] in the
model (`x [.., K] @ W [K, N]`, see surojax.models.layers.linear), K the input dimension, N the output dimension.

Storage rule, for every format: the packed arrays keep the layout of the format's home ecosystem, which is
the torch / HF / GGUF layout [N, K] row-major: one row per output feature, K (the input dimension) contiguous,
and the quantisation blocks run along K. `quantize(w)` therefore takes our [K, N] kernel and transposes it,
`dequantize()` unpacks [N, K] and transposes back to [K, N]. Leading dimensions on the packed arrays (for
instance a stacked `layers` axis, or `jax.lax.scan` slicing one off) pass through: `dequantize()` returns
[..., K, N]; the static metadata (`shape = (K, N)`) only describes the trailing matrix.

A format is a frozen dataclass whose array fields are pytree leaves and whose `static()` fields are pytree
metadata (hashable, part of the jit cache key), so `jax.jit`, `jax.tree.map`, `jax.device_put` and sharding
all treat a quantised weight like any other parameter pytree.

The fused kernels (pallas_kernels.quant_matmul) never see a format class: a format with a kernel sets
`kernel_spec` (a LayoutSpec: code packing, scale block, decode) and implements `kernel_values()` (its codes and
float32 scales in its own [N, K] row layout); `kernel_layout(kt)` hands them to `to_layout`, and `matmul` calls
`quant_matmul(x, self)`, which uses only `dequantize`, `kernel_spec`, `kernel_layout_error` and `kernel_layout`.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul import grouped_dot
from pallas_kernels.quant_matmul.api import quant_matmul
from surojax.kernel_settings import kernel_settings
from pallas_kernels.quant_matmul.layout import KernelLayout, LayoutSpec, layout_error, to_layout

FORMATS: dict[str, type["QuantFormat"]] = {}


def static(**kw):
    """A dataclass field that is pytree metadata (static under jit), not a leaf."""
    return dataclasses.field(metadata={"static": True}, **kw)


def register_format(name: str):
    """Class decorator: frozen dataclass + JAX pytree registration + entry in FORMATS under `name`."""
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        fields = dataclasses.fields(cls)
        meta = [f.name for f in fields if f.metadata.get("static")]
        data = [f.name for f in fields if not f.metadata.get("static")]
        jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
        cls.name = name
        FORMATS[name] = cls
        return cls
    return wrap


class QuantFormat:
    """Interface of a quantised [K, N] weight. Subclasses are made with @register_format."""

    name: ClassVar[str]
    data: jax.Array         # the packed codes; every subclass declares it (its first field)
    shape: tuple[int, int]  # (K, N) of the logical kernel; every subclass declares it as a static field
    packed_ndim: ClassVar[int] = 2        # ndim of one layer's `data` (more: leading, stacked axes)
    quantised: ClassVar[bool] = True      # False: a plain weight in a kernel's layout (GemvWeight, ExpertStack)
    kernel_spec: ClassVar[LayoutSpec | None] = None  # how the fused kernels decode it; None: no kernel

    @classmethod
    def quantize(cls, w: np.ndarray, **kw) -> "QuantFormat":
        """w: [K, N] float array (numpy or jax) -> packed format."""
        raise NotImplementedError

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        """-> [..., K, N] in `dtype` (pure jnp, jit-able)."""
        raise NotImplementedError

    @classmethod
    def bytes_per_value(cls) -> float:
        """Bytes a value of this format takes, scales included, at its default block layout (for memory plans)."""
        raise NotImplementedError(f"format {cls.name!r} states no bytes per value")

    @property
    def nbytes(self) -> int:
        """Bytes of the packed storage (all array leaves)."""
        return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(self)))

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ W [K, N] -> [..., N] in x's dtype. `pallas_kernels.quant_matmul.api.quant_matmul` picks
        the path: the fused Pallas dequantise + matmul kernel (custom_vjp, no weight gradient) or
        x @ dequantize() in XLA (the reference; always off GPU unless SUROJAX_QUANT_MATMUL=pallas: the kernel
        settings, surojax/kernel_settings.py)."""
        return quant_matmul(x, self, kernel_settings().quant_matmul.value)

    def grouped_matmul(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """E stacked experts (leaves [E, ...], `dequantize()` [E, K, N]): x [A, K], rows sorted by expert, group_sizes
        [E] -> [A, N] in x's dtype, each group's rows @ its expert's W; rows past sum(group_sizes) give 0.

        The reference path for every format: all E experts are dequantised at once (a full copy of this layer's
        expert weights in x's dtype, e.g. bf16, alive for the GEMM; under the decoder's layer scan that is one
        layer's experts at a time), then one grouped GEMM (pallas_kernels.grouped_matmul.grouped_dot). No gradient reaches the packed weight (codes
        are integers; QLoRA's base is frozen); x gets its exact gradient through the GEMM."""
        return grouped_dot(x, self.dequantize(x.dtype), group_sizes)

    def take_experts(self, ids: jax.Array) -> "QuantFormat":
        """E stacked experts (every array leaf [E, ...]) -> the experts `ids` [A] as the same format, leaves
        [A, ...]: the packed codes and scales gathered before any dequantisation, so the few-rows MoE path
        (pallas_kernels.grouped_matmul.gathered_dot) reads only the routed experts' quantised bytes. ValueError
        when a leaf does not carry the experts axis first."""
        num_experts = jnp.shape(self.data)[0] if jnp.ndim(self.data) > self.packed_ndim else None
        for f in dataclasses.fields(self):
            leaf = getattr(self, f.name)
            if f.metadata.get("static") or leaf is None:
                continue
            if num_experts is None or jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != num_experts:
                raise ValueError(f"{self.name}.take_experts: leaf {f.name} {tuple(jnp.shape(leaf))} does not carry the "
                                 f"experts axis first (data {tuple(jnp.shape(self.data))}: stacked experts expected)")
        return jax.tree.map(lambda leaf: jnp.take(leaf, ids, axis=0), self)

    def kernel_values(self) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """One layer's values for the kernel layout, in the format's row layout: codes [N, K] (one code per
        value), scale and offset [N, K/G] float32 (offset None unless kernel_spec.has_offset), computed with the
        same operations as `dequantize`, so that decode(code) * scale (- offset) equals it bit for bit. Only
        formats with a kernel_spec implement it."""
        raise NotImplementedError(f"format {self.name!r} has no fused kernel")

    def kernel_layout_error(self, kt: int) -> str | None:
        """Why this weight cannot use the fused kernels with K tile `kt` (None when it can)."""
        if self.kernel_spec is None:
            return f"no fused kernel for format {self.name!r}"
        lead = jnp.ndim(self.data) - self.packed_ndim
        if lead:
            return (f"{self.name}: the fused kernel takes one layer's weight; this one has {lead} leading (stacked) "
                    "axes (the decoder's scan slices them off)")
        return layout_error(self.kernel_spec, self.shape, kt)

    def kernel_layout(self, kt: int = 128) -> KernelLayout:
        """This layer's weight in the kernel layout with K tile kt (jnp, jit-able; ValueError: why it cannot)."""
        err = self.kernel_layout_error(kt)
        if err:
            raise ValueError(err)
        return to_layout(self.kernel_spec, *self.kernel_values(), kt=kt)

    def __repr__(self) -> str:  # arrays can be huge; show the shapes only
        leaves = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        parts = [f"{k}={v.dtype}{list(v.shape)}" if hasattr(v, "shape") else f"{k}={v!r}" for k, v in leaves.items()]
        return f"{type(self).__name__}({', '.join(parts)})"


def as_kn(w) -> np.ndarray:
    """Validate and convert a [K, N] kernel to float32 numpy."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D [in, out] kernel, got shape {w.shape}")
    return w


def to_kn(w_nk: jax.Array, dtype) -> jax.Array:
    """[..., N, K] -> [..., K, N] in dtype."""
    return jnp.swapaxes(w_nk, -1, -2).astype(dtype)


def f16_from_bytes(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] (little-endian fp16 bytes) -> float32 [...] (exact)."""
    u16 = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(u16, jnp.float16).astype(jnp.float32)


def u16_from_bytes(b: jax.Array) -> jax.Array:
    return b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)


def u32_from_bytes(b: jax.Array) -> jax.Array:
    b = b.astype(jnp.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def nibbles_lo_hi(qs: jax.Array) -> jax.Array:
    """uint8 [..., B] -> uint8 [..., 2, B]: low nibbles, then high nibbles."""
    return jnp.stack([qs & 0x0F, qs >> 4], axis=-2)
