"""LaidOutExperts: a layer stack of quantised expert weights [L, E, ...] kept in the fused kernels' layout
(pallas_kernels.quant_matmul.layout: codes, float32 scales / offsets), for the gathered quantised GEMV
(pallas_kernels.gathered_gemv.quant_kernel) to read each routed expert of a layer in place at decode.

Why. A decode step's few MoE rows take the gathered form (surojax.models.layers.moe.expert_path). With experts in
a format's native blocks, XLA gathers the routed experts' blocks, writes them dequantised to bf16 ([A, K, N]:
more bytes than a bf16 expert stack would have read) and reads them again: a Q4_K MoE layer of Qwen3-30B-A3B at one
row took 62-68 µs, no faster than bf16's. The kernel instead reads the routed experts' layout bytes once and
decodes them in registers. A served model converts its quantised expert stacks once at load
(`LaidOutExperts.from_stack`, called by surojax.quant.laid_out.experts_in_place when SUROJAX_MOE_GATHER_KERNEL
resolves to the kernel: pallas_kernels.gathered_gemv.api.quant_converts), one layer at a time into preallocated
arrays, so the peak is the two stacks and one layer's temporaries.

    data    codes [L, E, K/2 or K, N]          the layout's codes (4-bit codes two to a byte)
    scale   [L, E, K/G, N] float32 or None, offset the same or None
    layer   None, or an int32 scalar: this is layer `layer` of the stack (`at_layer`: the decoder's scan hands
            over the whole stack and the index, as for every `stacked_in_place` weight)
    spec, shape (K, N), kt, source             static: the layout's, and the format laid out from

Memory: the layout keeps float32 scales (and offsets) per block: Q4_K 6 bits per weight instead of 4.5 (laid_out.py
says the same of the dense layouts). The grouped GEMM (prefill, many rows) dequantises the layer's E experts
from the layout, as it does from native blocks. Serving only: the values are the source format's, bit for bit
(the layout's contract, `dequantize`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.gathered_gemv.api import gathered_quant_gemv
from pallas_kernels.quant_matmul.layout import KernelLayout, LayoutSpec, layout_error
from pallas_kernels.quant_matmul.reference import dequantize_layout
from surojax.quant.base import QuantFormat


@dataclasses.dataclass(frozen=True)
class LaidOutExperts(QuantFormat):
    data: jax.Array
    scale: jax.Array | None
    offset: jax.Array | None
    layer: jax.Array | None
    spec: LayoutSpec = dataclasses.field(metadata={"static": True})
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    kt: int = dataclasses.field(metadata={"static": True})
    source: str = dataclasses.field(metadata={"static": True})

    stacked_in_place = True   # the decoder's layer scan hands over the whole stack and the index (at_layer)
    experts_in_place = True   # ExpertLinear.gathered calls `gathered`
    name = "experts_laid_out"  # not in FORMATS: made from a loaded quantised expert stack, never quantised
    packed_ndim = 3           # one layer's codes [E, rows, N]

    @staticmethod
    def error(w, kt: int = 128) -> str | None:
        """Why the quantised expert stack w (leaves [L, E, ...]) cannot be laid out (None: it can)."""
        if not isinstance(w, QuantFormat) or w.kernel_spec is None or not w.quantised:
            return f"{getattr(w, 'name', type(w).__name__)}: not a quantised format with a fused-kernel layout"
        if jnp.ndim(w.data) != w.packed_ndim + 2:
            return f"{w.name}: an expert stack [L, E, ...] expected, data {tuple(jnp.shape(w.data))}"
        one = jax.eval_shape(lambda v: jax.tree.map(lambda a: a[0, 0], v), w)
        return one.kernel_layout_error(kt) or layout_error(w.kernel_spec, w.shape, kt)

    @classmethod
    def from_stack(cls, w: QuantFormat, kt: int = 128) -> "LaidOutExperts":
        """A quantised expert stack (leaves [L, E, ...]) -> its layout, one layer at a time. ValueError: why not."""
        err = cls.error(w, kt)
        if err:
            raise ValueError(f"LaidOutExperts: {err}")
        num_layers = jnp.shape(w.data)[0]
        one_layer = jax.jit(jax.vmap(lambda v: v.kernel_layout(kt)))  # one layer's E experts
        shapes = jax.eval_shape(one_layer, jax.tree.map(lambda a: a[0], w))
        stack = [None if s is None else jnp.zeros((num_layers, *s.shape), s.dtype)
                 for s in (shapes.codes, shapes.scale, shapes.offset)]

        def put(stack, w, i):  # layer i's layout written into the stacks (donated: updated in place)
            lw = one_layer(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), w))
            return [None if s is None else jax.lax.dynamic_update_index_in_dim(s, v, i, 0)
                    for s, v in zip(stack, (lw.codes, lw.scale, lw.offset))]

        put = jax.jit(put, donate_argnums=0)
        for i in range(num_layers):
            stack = put(stack, w, jnp.int32(i))
        return cls(data=stack[0], scale=stack[1], offset=stack[2], layer=None, spec=shapes.spec, shape=w.shape,
                   kt=kt, source=w.name)

    @classmethod
    def bytes_per_value(cls) -> float:
        raise NotImplementedError("experts_laid_out keeps its source format's layout: see nbytes")

    @property
    def num_experts(self) -> int:
        return self.data.shape[1]

    def at_layer(self, index: jax.Array) -> "LaidOutExperts":
        if self.layer is not None or self.data.ndim != 4:
            raise ValueError(f"experts_laid_out ({self.source}): at_layer needs the whole stack [L, E, ...], data "
                             f"{self.data.shape}, layer {self.layer}")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def _stack(self) -> KernelLayout:
        """The whole stack as one KernelLayout with arrays [L E, ...] (free reshapes)."""
        flat = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])  # noqa: E731
        return KernelLayout(codes=flat(self.data), scale=flat(self.scale), offset=flat(self.offset), spec=self.spec,
                            shape=self.shape, kt=self.kt)

    def gathered(self, x: jax.Array, expert_ids: jax.Array, mode: str = "auto") -> jax.Array:
        """x [A, K], expert_ids [A] -> [A, N]: row a against this layer's expert expert_ids[a], read in place (the
        kernel under `mode`, pallas_kernels.gathered_gemv.api.quant_choose; else the reference's gather)."""
        if self.layer is None:
            raise ValueError(f"experts_laid_out ({self.source}): a stack; the decoder's scan gives a layer "
                             "(at_layer)")
        return gathered_quant_gemv(x, self._stack(), expert_ids, num_experts=self.num_experts,
                                   base=self.layer * self.num_experts, mode=mode)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        """-> [E, K, N] of this layer (layer set), else [L, E, K, N], in dtype."""
        arrays = (self.data, self.scale, self.offset)
        if self.layer is not None:
            arrays = tuple(None if a is None else jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False)
                           for a in arrays)
        f = lambda c, s, o: dequantize_layout(KernelLayout(c, s, o, self.spec, self.shape, self.kt))  # noqa: E731
        for _ in range(arrays[0].ndim - 2):
            f = jax.vmap(f)
        return f(*arrays).astype(dtype)

    def take_experts(self, ids: jax.Array) -> QuantFormat:
        raise ValueError("experts_laid_out: the gathered form reads the stack in place (`gathered`), not "
                         "take_experts")

    def __repr__(self) -> str:
        return f"LaidOutExperts({self.source}, {self.spec.name}, data={self.data.dtype}{list(self.data.shape)})"


jax.tree_util.register_dataclass(LaidOutExperts, data_fields=["data", "scale", "offset", "layer"],
                                 meta_fields=["spec", "shape", "kt", "source"])


__all__ = ["LaidOutExperts"]
