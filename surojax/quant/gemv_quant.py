"""GemvQuant: a quantised Linear kernel kept in the quantised decode GEMV's layout ([N, K]-major rows, 4-bit codes
half-split per K block, float32 scales / offsets: pallas_kernels.decode_gemv.quant_kernel.QuantRows), for serving.

A decode step multiplies one row (one user) by every weight; the fused quantised GEMM's decode form
(pallas_kernels.quant_matmul, the LaidOut layout) pads the row to 16, splits K over programs and sums the fp32
partials in a second kernel, and takes none of the decoder's fusions, so a small model's Q4_K decoded slower than
its bf16 through the plain decode GEMV (Qwen3-0.6B on an H100: 580 against 660 tok/s, benchmarks/RESULTS.md). The
quantised decode GEMV reads these rows in one launch per linear with the plain kernel's RMSNorm prologue, gated
product and residual (`fused_matmul`, as GemvWeight). A served model converts its layer stacks' quantised Linear
kernels once at load (`surojax.quant.laid_out.quant_for_gemv`, called by `decode_weights` where
SUROJAX_DECODE_GEMV resolves to it: pallas_kernels.decode_gemv.api.quant_converts).

    data    codes [..., N, K/2] (4-bit codes) or [..., N, K]    (leading axes: the stacked layers)
    scale   [..., N, K/G] float32 or None, offset the same or None
    layer   None, or an int32 scalar: the arrays are the whole stack [L, ...] and this is layer `layer`, read in
            place (`at_layer`: the decoder's layer scan hands the stack and the index)
    spec, shape (K, N), bk, source     static: the format's decode, the layout's K block, the format laid out from

`matmul(x)` takes the kernel for calls of few rows (quant_choose: M <= 8), and XLA's dequantise-then-einsum on the
decoded rows otherwise (prefill). The values are the source format's, bit for bit (`dequantize`). Memory: Q4_K 6
bits a weight (fp32 scale and offset per 32 values) instead of 4.5. Serving only: no gradient.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_gemv.api import decode_gemv_quant, quant_bk, quant_choose, quant_weight_error
from pallas_kernels.decode_gemv.quant_kernel import MixedRows, QuantRows, pack_rows, unpack_rows
from pallas_kernels.quant_matmul.layout import LayoutSpec
from surojax.kernel_settings import kernel_settings
from surojax.models.layers.stacked_vector import in_place
from surojax.quant.base import QuantFormat
from surojax.quant.gemv_weight import KERNEL_ACTIVATIONS
from surojax.quant.gguf_mixed import GGUFMixed


class _KernelCalls:
    """matmul / fused_matmul through the quantised decode GEMV where `_kernel_takes` says so, for GemvQuant and
    GemvQuantMixed: they give `_kernel_rows()` (what the kernel reads), `_layer()`, `shape`, and `_xla(x)`."""

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ W -> [..., N] in x's dtype (the kernel for few rows, else XLA on the decoded layer)."""
        if self._kernel_takes(x):
            return decode_gemv_quant(x, self._kernel_rows(), n=self.shape[1], layer=self._layer())
        return self._xla(x)

    def fused_matmul(self, x: jax.Array, *, norm_weight=None, eps: float = 1e-6, zero_centered: bool = False,
                     activation: str | None = None, residual: jax.Array | None = None) -> jax.Array | None:
        """GemvWeight.fused_matmul's contract on the quantised kernel: the result, or None where the kernel does
        not take this call (the caller runs the ops itself)."""
        act = None if activation is None else KERNEL_ACTIVATIONS.get(activation)
        if (activation is not None and act is None) or not self._kernel_takes(x) \
                or quant_weight_error(self.shape[1], act is not None):
            return None
        norm = None if norm_weight is None else ("zero_centered" if zero_centered else "plain")
        norm_weight, norm_layer = (None, None) if norm_weight is None else in_place(norm_weight)
        return decode_gemv_quant(x, self._kernel_rows(), n=self.shape[1], layer=self._layer(),
                                 norm_weight=norm_weight, norm_layer=norm_layer, norm=norm, eps=eps, activation=act,
                                 residual=residual)


@dataclasses.dataclass(frozen=True)
class GemvQuant(_KernelCalls, QuantFormat):
    data: jax.Array
    scale: jax.Array | None
    offset: jax.Array | None
    layer: jax.Array | None
    spec: LayoutSpec = dataclasses.field(metadata={"static": True})
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    bk: int = dataclasses.field(metadata={"static": True})
    source: str = dataclasses.field(metadata={"static": True})

    stacked_in_place = True  # the decoder's layer scan hands over the whole stack and the index (at_layer)
    name = "gemv_q"          # not in FORMATS: made from a loaded quantised kernel, never quantised from floats

    @staticmethod
    def error(w) -> str | None:
        """Why the stacked weight w ([L, ...] leaves) cannot be laid out (None: it can)."""
        if not isinstance(w, QuantFormat) or w.kernel_spec is None or not w.quantised:
            return f"{getattr(w, 'name', type(w).__name__)}: not a quantised format with a kernel decoding"
        if jnp.ndim(w.data) != w.packed_ndim + 1:
            return f"{w.name}: one stacked layers axis expected, data {tuple(jnp.shape(w.data))}"
        k, n = w.shape
        bk = quant_bk(w.kernel_spec, k)
        if bk is None:
            return f"{w.name}: K={k} has no K block the quantised decode GEMV can take"
        one = jax.eval_shape(lambda v: jax.tree.map(lambda a: a[0], v), w)  # the format's own conditions (FP8's
        return one.kernel_layout_error(bk) or quant_weight_error(n)          # scale blocks), shapes only

    @classmethod
    def from_weight(cls, w: QuantFormat) -> "GemvQuant":
        """A quantised stacked kernel (leaves [L, ...]) -> its rows (one jitted pass). ValueError: why not."""
        err = cls.error(w)
        if err:
            raise ValueError(f"GemvQuant: {err}")
        spec, (k, _) = w.kernel_spec, w.shape
        bk = quant_bk(spec, k)
        rows = jax.jit(jax.vmap(lambda v: pack_rows(spec, *v.kernel_values(), bk)))(w)
        return cls(data=rows.codes, scale=rows.scale, offset=rows.offset, layer=None, spec=spec, shape=w.shape,
                   bk=bk, source=w.name)

    @classmethod
    def bytes_per_value(cls) -> float:
        raise NotImplementedError("gemv_q keeps its source format's values in its own layout: see nbytes")

    def at_layer(self, index: jax.Array) -> "GemvQuant":
        if self.data.ndim != 3 or self.layer is not None:
            raise ValueError(f"gemv_q ({self.source}): at_layer needs one stacked layers axis, data {self.data.shape}, "
                             f"layer {self.layer}")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def join_columns(self, parts: list) -> "GemvQuant | None":
        """parts (this first) side by side along N (the rows); None where they differ in format, block or stacking."""
        key = lambda p: (p.spec, p.bk, p.source, p.shape[0], p.layer is None, p.data.shape[:-2])  # noqa: E731
        if not all(isinstance(p, GemvQuant) and key(p) == key(self) for p in parts) or self.layer is not None:
            return None
        join = lambda arrays: None if arrays[0] is None else jnp.concatenate(arrays, axis=-2)  # noqa: E731
        return dataclasses.replace(self, data=join([p.data for p in parts]), scale=join([p.scale for p in parts]),
                                   offset=join([p.offset for p in parts]),
                                   shape=(self.shape[0], sum(p.shape[1] for p in parts)))

    def _rows(self, own: bool) -> QuantRows:
        """own: this weight's rows alone (its layer sliced out of a stack); else the arrays flattened to [L N, ·]
        (free reshapes) for the kernel, which offsets its rows by the layer."""
        arrays = (self.data, self.scale, self.offset)
        if own and self.layer is not None:
            arrays = tuple(None if a is None else jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False)
                           for a in arrays)
        elif not own:
            arrays = tuple(None if a is None else a.reshape(-1, a.shape[-1]) for a in arrays)
        return QuantRows(*arrays, spec=self.spec, k=self.shape[0], bk=self.bk)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return jnp.swapaxes(unpack_rows(self._rows(own=True)), -1, -2).astype(dtype)

    def _kernel_takes(self, x: jax.Array) -> bool:
        one_layer = self.data.ndim - (self.layer is not None) == 2
        m = int(np.prod(x.shape[:-1]))
        return one_layer and quant_choose(m, kernel_settings().decode_gemv.value) == "pallas"

    def _layer(self):
        return 0 if self.layer is None else self.layer

    def _kernel_rows(self) -> QuantRows:
        return self._rows(own=False)

    def _xla(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...k,nk->...n", x, unpack_rows(self._rows(own=True)).astype(x.dtype))

    def __repr__(self) -> str:
        return f"GemvQuant({self.source}, {self.spec.name}, data={self.data.dtype}{list(self.data.shape)})"


jax.tree_util.register_dataclass(GemvQuant, data_fields=["data", "scale", "offset", "layer"],
                                 meta_fields=["spec", "shape", "bk", "source"])


@dataclasses.dataclass(frozen=True)
class GemvQuantMixed(_KernelCalls, QuantFormat):
    """A layer stack whose layers come in different GGUF types (`GGUFMixed`: llama.cpp's Q4_K_M gives attn_v and
    ffn_down Q6_K on some layers), in the quantised decode GEMV's rows per type: one GemvQuant stack per type
    holding its layers, each layer's type (`kind` [L]) and its index in that stack (`pos` [L]). The kernel branches
    on the layer's type inside itself (pallas_kernels.decode_gemv.quant_kernel.MixedRows), so no layer pays a
    host-side switch; XLA's path (prefill) decodes the layer through `lax.switch`. Values: each layer's own type's,
    bit for bit."""

    parts: tuple[GemvQuant, ...]
    kind: jax.Array
    pos: jax.Array
    layer: jax.Array | None
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    source: str = dataclasses.field(metadata={"static": True})

    stacked_in_place = True
    name = "gemv_q_mixed"
    data = property(lambda self: self.parts[0].data)  # QuantFormat's leading-axes convention (nbytes, logs)

    @staticmethod
    def error(w) -> str | None:
        """Why the mixed stack w cannot be laid out (None: it can): each type's layers as GemvQuant's."""
        if not isinstance(w, GGUFMixed) or jnp.ndim(w.data) != 3:
            return "not a per-layer mix of GGUF types over one stacked layers axis"
        kind = np.asarray(w.kind)
        for t, name in enumerate(w.types):
            layers = np.flatnonzero(kind == t)[:1]
            err = GemvQuant.error(w.typed(name, w.data[layers])) if len(layers) else None
            if err:
                return err
        return None

    @classmethod
    def from_mixed(cls, w: GGUFMixed) -> "GemvQuantMixed":
        err = cls.error(w)
        if err:
            raise ValueError(f"GemvQuantMixed: {err}")
        kind = np.asarray(w.kind)
        parts, pos = [], np.zeros_like(kind)
        for t, name in enumerate(w.types):
            layers = np.flatnonzero(kind == t)
            pos[layers] = np.arange(len(layers))
            parts.append(GemvQuant.from_weight(w.typed(name, w.data[jnp.asarray(layers)])))
        return cls(parts=tuple(parts), kind=jnp.asarray(kind), pos=jnp.asarray(pos), layer=None, shape=w.shape,
                   source="+".join(w.types))

    def at_layer(self, index: jax.Array) -> "GemvQuantMixed":
        if self.layer is not None:
            raise ValueError(f"gemv_q_mixed ({self.source}): already one layer")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        if self.layer is None:
            raise ValueError(f"gemv_q_mixed ({self.source}): a stack; the decoder's scan gives a layer (at_layer)")
        pos = self.pos[self.layer]
        branches = [lambda pos, p=p: p.at_layer(pos).dequantize(dtype) for p in self.parts]
        return jax.lax.switch(self.kind[self.layer], branches, pos)

    def _kernel_takes(self, x: jax.Array) -> bool:
        m = int(np.prod(x.shape[:-1]))
        return self.layer is not None and quant_choose(m, kernel_settings().decode_gemv.value) == "pallas"

    def _layer(self):
        return self.layer

    def _kernel_rows(self) -> MixedRows:
        return MixedRows(parts=tuple(p._rows(own=False) for p in self.parts), kind=self.kind, pos=self.pos)

    def _xla(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...k,kn->...n", x, self.dequantize(x.dtype))

    def __repr__(self) -> str:
        return f"GemvQuantMixed({self.source}, layers {[p.data.shape[0] for p in self.parts]})"


jax.tree_util.register_dataclass(GemvQuantMixed, data_fields=["parts", "kind", "pos", "layer"],
                                 meta_fields=["shape", "source"])

__all__ = ["GemvQuant", "GemvQuantMixed"]
