"""LaidOut: a weight kept in the fused kernels' layout (pallas_kernels.quant_matmul.layout), for serving.

Every quantised format hands its values to the kernels through `kernel_layout(kt)`, a jnp pass over the packed
bytes. Training pays it once per step per layer, next to GEMMs of M = 8192 rows. A decode step is the other way
round: M is the number of running sequences (1-64), the GEMV reads each weight once, and the re-layout would
read and write every byte again on every token. So a served model converts each weight that the decode kernel
will take once, at load (`lay_out_model`), into a LaidOut: the KernelLayout's arrays with the stacked layers axis
first. The decoder's layer scan does not slice a LaidOut (`Decoder.split_in_place`, `stacked_in_place`): it
hands each layer the whole stack and the layer index (`at_layer`), and the kernel reads its layer in place
(XLA would copy a sliced operand out of the stack before the kernel's custom call).

    data    codes  [..., K/2 or K, N]   (the layout's codes; for a plain weight the weight itself)
    scale   [..., K/G, N] float32 or None, offset the same or None
    spec, shape (K, N), kt              static: the layout's
    source                              static: the format it was laid out from (logs, errors)

It is a PackedWeight (pallas_kernels.quant_matmul.api): `dequantize` decodes the layout (bit-identical to the
source format's own dequantize: the layout's contract, tested per format), so prefill and any M above the
decode crossover run the XLA path on the same values (somewhat slower to decode than the native blocks: a
longer time to the first token of a Qwen3-8B Q4_K prompt, benchmarks/RESULTS.md#s11);
`kernel_layout(kt)` costs nothing (`layout_is_free`), which is what lets `quant_matmul`'s auto dispatch pick
the decode kernel for small M. Memory: the layout keeps float32 scales (and offsets) per block: Q4_K 6 bits per
weight instead of 4.5, Q6_K ~10 instead of 6.6, NF4 4.5 (~4.1 with double quantisation).

Plain kernels have a second decode path: `transpose_for_gemv` turns them into GemvWeights ([N, K], K contiguous;
surojax.quant.gemv_weight) for the decode GEMV kernel (pallas_kernels.decode_gemv), when SUROJAX_DECODE_GEMV says
(decode_weights runs it first; the plain kernels it takes are then no longer LaidOut candidates).
"""
from __future__ import annotations

import collections
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.decode_gemv.api import converts as gemv_converts
from pallas_kernels.decode_gemv.api import quant_converts as quant_converts_gemv
from pallas_kernels.decode_gemv.api import weight_error as gemv_weight_error
from pallas_kernels.gathered_gemv.api import converts as gathered_converts
from pallas_kernels.gathered_gemv.api import quant_converts
from pallas_kernels.quant_matmul.api import decode_layouts
from pallas_kernels.quant_matmul.layout import PLAIN, KernelLayout, LayoutSpec, layout_error, plain_layout
from pallas_kernels.quant_matmul.reference import dequantize_layout
from surojax.kernel_settings import kernel_settings
from surojax.models.fused_projections import fuse_projections
from surojax.models.layers.linear import Linear
from surojax.models.layers.moe import ExpertLinear
from surojax.models.layers.norm import RMSNorm
from surojax.models.layers.stacked_vector import StackedVector
from surojax.quant.base import FORMATS, QuantFormat
from surojax.quant.expert_layout import LaidOutExperts
from surojax.quant.expert_stack import ExpertStack
from surojax.quant.gemv_quant import GemvQuant, GemvQuantMixed
from surojax.quant.gemv_weight import GemvWeight
from surojax.quant.gguf_mixed import GGUFMixed
from surojax.quant.transform import QuantParam

log = logging.getLogger("surojax.quant")


@dataclasses.dataclass(frozen=True)
class LaidOut(QuantFormat):
    data: jax.Array
    scale: jax.Array | None
    offset: jax.Array | None
    layer: jax.Array | None     # None: the arrays are this weight's (leading axes stacked); an int32 scalar: they
    #                             are the whole stack [L, ...] and this is layer `layer`, read in place (at_layer)
    spec: LayoutSpec = dataclasses.field(metadata={"static": True})
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    kt: int = dataclasses.field(metadata={"static": True})
    source: str = dataclasses.field(metadata={"static": True})

    layout_is_free = True   # kernel_layout is these arrays: quant_matmul may take the decode kernel for small M
    stacked_in_place = True  # the decoder's layer scan hands over the whole stack and the index (at_layer)
    name = "laid_out"       # not in FORMATS: made from a loaded weight (lay_out), never quantised from floats

    @property
    def kernel_spec(self) -> LayoutSpec:
        return self.spec

    def at_layer(self, index: jax.Array) -> "LaidOut":
        """Layer `index` of this [L, ...] stack, its arrays left whole (the kernel reads the layer in place)."""
        if self.data.ndim != 3 or self.layer is not None:
            raise ValueError(f"laid_out ({self.source}): at_layer needs one stacked layers axis, data "
                             f"{self.data.shape}, layer {self.layer}")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def join_columns(self, parts: list) -> "LaidOut | None":
        """parts (this weight first) side by side along N: one [..., K, sum N] weight of the same layout, or None
        when they differ in layout, K tile, source format, K or stacking. Exact: every array of a layout keeps N
        as its last, contiguous axis and no column depends on another (layout.py)."""
        key = lambda p: (p.spec, p.kt, p.source, p.shape[0], p.layer is None, p.data.shape[:-1])  # noqa: E731
        if not all(isinstance(p, LaidOut) and key(p) == key(self) for p in parts) or self.layer is not None:
            return None
        join = lambda arrays: None if arrays[0] is None else jnp.concatenate(arrays, axis=-1)  # noqa: E731
        return dataclasses.replace(self, data=join([p.data for p in parts]), scale=join([p.scale for p in parts]),
                                   offset=join([p.offset for p in parts]),
                                   shape=(self.shape[0], sum(p.shape[1] for p in parts)))

    def _layout(self) -> KernelLayout:
        return KernelLayout(codes=self.data, scale=self.scale, offset=self.offset, spec=self.spec,
                            shape=self.shape, kt=self.kt)

    def _own(self) -> tuple:
        """(codes, scale, offset) of this weight alone: layer `layer` sliced out of the stack when it is set."""
        arrays = (self.data, self.scale, self.offset)
        if self.layer is None:
            return arrays
        return tuple(None if a is None else jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False)
                     for a in arrays)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        """-> [..., K, N] in dtype: the layout decoded (leading, stacked axes pass through)."""
        f = lambda d, s, o: dequantize_layout(dataclasses.replace(self._layout(), codes=d, scale=s, offset=o))  # noqa: E731
        data, scale, offset = self._own()
        for _ in range(data.ndim - 2):
            f = jax.vmap(f)
        return f(data, scale, offset).astype(dtype)

    def kernel_layout_error(self, kt: int) -> str | None:
        if self.data.ndim - (self.layer is not None) != 2:  # one layer: its own arrays, or a stack and an index
            return (f"laid_out ({self.source}): the fused kernel takes one layer's weight; this one is a stack "
                    f"{self.data.shape} without a layer index (the decoder's scan gives it one: at_layer)")
        if kt != self.kt:
            return f"laid_out ({self.source}): laid out with K tile {self.kt}, asked for {kt}"
        return None

    def kernel_layout(self, kt: int | None = None) -> KernelLayout:
        err = self.kernel_layout_error(self.kt if kt is None else kt)
        if err:
            raise ValueError(err)
        return self._layout()

    def __repr__(self) -> str:
        return f"LaidOut({self.source}, {self.spec.name}, data={self.data.dtype}{list(self.data.shape)})"


jax.tree_util.register_dataclass(LaidOut, data_fields=["data", "scale", "offset", "layer"],
                                 meta_fields=["spec", "shape", "kt", "source"])


@dataclasses.dataclass(frozen=True)
class LaidOutMixed(QuantFormat):
    """A layer stack whose layers come in different formats (a GGUF Q4_K_M file's attn_v / ffn_down: Q4_K on some
    layers, Q6_K on others; `GGUFMixed`), laid out per format: one LaidOut stack per format holding its layers,
    and for each layer its format (`kind` [L]) and its index in that stack (`pos` [L]). A layer (`at_layer`, what
    the decoder's scan hands it) multiplies through its own format's kernel, chosen by `lax.switch`; each branch
    reads its layer of its stack in place, and quant_matmul's auto dispatch decides per format (Q4_K and Q6_K have
    different crossovers). `dequantize` of a layer is its format's values, bit for bit (LaidOut's contract)."""
    parts: tuple[LaidOut, ...]
    kind: jax.Array
    pos: jax.Array
    layer: jax.Array | None
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})
    source: str = dataclasses.field(metadata={"static": True})

    stacked_in_place = True
    name = "laid_out_mixed"
    data = property(lambda self: self.parts[0].data)  # QuantFormat's leading-axes convention (nbytes, logs)

    def at_layer(self, index: jax.Array) -> "LaidOutMixed":
        if self.layer is not None:
            raise ValueError(f"laid_out_mixed ({self.source}): already one layer")
        return dataclasses.replace(self, layer=jnp.asarray(index, jnp.int32))

    def _switch(self, per_part):
        """per_part(LaidOut of this layer) over the layer's own format (layer set: one branch runs)."""
        if self.layer is None:
            raise ValueError(f"laid_out_mixed ({self.source}): a stack; the decoder's scan gives a layer (at_layer)")
        pos = self.pos[self.layer]
        branches = [lambda pos, p=p: per_part(p.at_layer(pos)) for p in self.parts]
        return jax.lax.switch(self.kind[self.layer], branches, pos)

    def matmul(self, x: jax.Array) -> jax.Array:
        return self._switch(lambda w: w.matmul(x))

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        if self.layer is not None:
            return self._switch(lambda w: w.dequantize(dtype))
        stacked = jnp.concatenate([p.dequantize(dtype) for p in self.parts])  # parts in order of kind
        starts = np.cumsum([0] + [p.data.shape[0] for p in self.parts])[:-1]
        return stacked[jnp.asarray(starts)[self.kind] + self.pos]

    def __repr__(self) -> str:
        return f"LaidOutMixed({self.source}, layers {[p.data.shape[0] for p in self.parts]})"


jax.tree_util.register_dataclass(LaidOutMixed, data_fields=["parts", "kind", "pos", "layer"],
                                 meta_fields=["shape", "source"])


def lay_out_mixed(w: GGUFMixed, kt: int = 128) -> LaidOutMixed | None:
    """A GGUFMixed stack [L, ...] -> one LaidOut stack per GGUF type (its layers, in order), or None when a type
    has no kernel layout. `kind` is read on the host (a loaded file's, concrete)."""
    if w.data.ndim != 3:
        return None
    kind = np.asarray(w.kind)
    parts, pos = [], np.zeros_like(kind)
    for t, name in enumerate(w.types):
        layers = np.flatnonzero(kind == t)
        pos[layers] = np.arange(len(layers))
        part = lay_out(w.typed(name, w.data[jnp.asarray(layers)]), kt)  # that type's layers, [L_t, N, R]
        if part is None:
            return None
        parts.append(part)
    return LaidOutMixed(parts=tuple(parts), kind=jnp.asarray(kind), pos=jnp.asarray(pos), layer=None, shape=w.shape,
                        source="+".join(w.types))


def _one_layer(w: QuantFormat) -> QuantFormat:
    """The first layer of a stacked weight, abstract (shapes only: for its kernel_layout_error, nothing copied)."""
    return jax.eval_shape(lambda v: jax.tree.map(lambda x: x[0], v), w)


def lay_out(w, kt: int = 128) -> LaidOut | None:
    """One stacked weight ([L, K, N] plain array or a QuantFormat with a kernel, one leading layers axis) ->
    LaidOut, or None when the kernels cannot take it (no kernel for its format, K / N off the tiles, not one
    leading axis). One jitted pass over its bytes."""
    if isinstance(w, LaidOut):
        return w
    if isinstance(w, QuantFormat):
        spec, lead, source = w.kernel_spec, w.data.ndim - w.packed_ndim, w.name
        per_layer = lambda v: v.kernel_layout(kt)  # noqa: E731
    else:
        source = jnp.dtype(w.dtype).name
        spec, lead = PLAIN.get(source), w.ndim - 2
        per_layer = lambda v: plain_layout(v, kt)  # noqa: E731
    # one stacked layers axis, as the decoder's scan holds a Linear (not experts [L, E, ...])
    if spec is None or lead != 1 or layout_error(spec, tuple(w.shape[-2:]), kt):
        return None
    if isinstance(w, QuantFormat) and _one_layer(w).kernel_layout_error(kt):  # the format's own conditions (FP8
        return None                                                           # scale blocks narrower than 128)
    lw = jax.jit(jax.vmap(per_layer))(w)
    return LaidOut(data=lw.codes, scale=lw.scale, offset=lw.offset, layer=None, spec=lw.spec, shape=lw.shape,
                   kt=lw.kt, source=source)


def _wanted_layout(w, formats: frozenset[str]) -> str | None:
    """w's layout name ("q4_k", "bfloat16", "q4_k+q6_k" for a mixed stack) when `formats` asks for it ("*": every
    quantised format with a kernel), else None."""
    def wanted(name: str, quantised: bool) -> bool:
        return name in formats or (quantised and "*" in formats)

    if isinstance(w, GGUFMixed):  # every type present must be one the caller converts
        names = [FORMATS[t].kernel_spec.name if FORMATS[t].kernel_spec else t for t in w.types]
        return "+".join(names) if all(wanted(t, True) for t in names) else None
    if isinstance(w, QuantFormat):  # LaidOut / LaidOutMixed already: kernel_spec, or none
        return w.kernel_spec.name if w.kernel_spec is not None and wanted(w.kernel_spec.name, True) else None
    name = jnp.dtype(w.dtype).name if hasattr(w, "dtype") else None
    return name if name is not None and wanted(name, False) else None


def _stack_modules(model):
    """The modules of every scanned layer stack of `model` (`Decoder.stacks`: `layers`, and a hybrid's
    `linear_layers` / LFM2's `conv_layers` ...; a model without `stacks`: its `layers`, or itself). A stack left
    out would keep its kernels as plain [L, K, N] arrays: the scan slices each layer's weight out of the stack
    (a weight-sized copy per layer and token) for an XLA GEMM."""
    stacks = getattr(model, "stacks", None)
    for stack in stacks.values() if isinstance(stacks, dict) else (getattr(model, "layers", model),):
        for _, module in nnx.iter_graph(stack):
            yield module


def lay_out_model(model, formats: frozenset[str], min_values: int = 0, kt: int = 128) -> dict[str, int]:
    """Convert, in place, every Linear kernel of `model` whose layout name (a quantised format's spec name, or
    the dtype name of a plain kernel: "bfloat16") is in `formats` ("*" in it: every quantised format with a
    kernel) and that holds at least `min_values` values per layer (K x N) into a LaidOut;
    pallas_kernels.quant_matmul.api.decode_layouts() says which a server converts.
    Only the decoder's layer stacks are walked (every one of `Decoder.stacks`, `_stack_modules`): the embedding,
    the LM head (read whole by `Decoder.logits`) and expert (grouped) weights stay as they are.
    -> {layout name: kernels converted}."""
    done: dict[str, int] = {}
    if not formats:
        return done
    for module in _stack_modules(model):
        var = getattr(module, "kernel", None) if isinstance(module, nnx.Module) else None
        if not isinstance(var, nnx.Param):   # a Linear's kernel [L, K, N] (experts [L, E, K, N]: lay_out refuses)
            continue
        w = var.get_value()
        name = _wanted_layout(w, formats)
        if name is None:
            continue
        k, n = w.shape if isinstance(w, QuantFormat) else w.shape[-2:]
        if k * n < min_values:
            continue
        laid = lay_out_mixed(w, kt) if isinstance(w, GGUFMixed) else lay_out(w, kt)
        if laid is None:
            continue
        module.kernel = QuantParam(laid, **var.get_metadata())
        done[name] = done.get(name, 0) + 1
    return done


GEMV_DTYPES = ("bfloat16", "float16", "float32")  # plain kernels the decode GEMV takes


def _plain_kernels(model, module_type, ndim: int):
    """(module, its kernel Param, the array) for every `module_type` in the decoder's layer stacks whose kernel is
    a plain array of `ndim` dimensions (a quantised or already converted one is skipped)."""
    for module in _stack_modules(model):
        var = getattr(module, "kernel", None) if isinstance(module, module_type) else None
        if isinstance(var, nnx.Param) and isinstance(w := var.get_value(), jax.Array) and w.ndim == ndim:
            yield module, var, w


def transpose_for_gemv(model) -> dict[str, int]:
    """Convert, in place, every plain Linear kernel [L, K, N] of the decoder's layer stacks (a dtype of GEMV_DTYPES,
    a shape the kernel tiles) into a GemvWeight [L, N, K] (surojax.quant.gemv_weight) for the decode GEMV
    kernel. The embedding, the LM head and expert weights stay as they are. -> {"gemv_t:<dtype>": kernels}."""
    done: collections.Counter[str] = collections.Counter()
    for module, var, w in _plain_kernels(model, Linear, 3):
        if jnp.dtype(w.dtype).name in GEMV_DTYPES and not gemv_weight_error(w.shape[2], w.shape[1]):
            module.kernel = QuantParam(jax.jit(GemvWeight.from_kernel)(w), **var.get_metadata())
            done[f"gemv_t:{jnp.dtype(w.dtype).name}"] += 1
    return dict(done)


def quant_for_gemv(model) -> dict[str, int]:
    """Convert, in place, every quantised Linear kernel of the decoder's layer stacks that the quantised decode GEMV
    takes (a format with a kernel decoding, one stacked layers axis, a K it can block) into a GemvQuant
    (surojax.quant.gemv_quant), a per-layer mix of GGUF types into a GemvQuantMixed. -> {"gemv_q:<format>":
    kernels converted}."""
    done: collections.Counter[str] = collections.Counter()
    for module in _stack_modules(model):
        var = getattr(module, "kernel", None) if isinstance(module, Linear) else None
        if not (isinstance(var, nnx.Param) and isinstance(w := var.get_value(), QuantFormat)):
            continue
        if isinstance(w, GGUFMixed) and GemvQuantMixed.error(w) is None:
            module.kernel = QuantParam(GemvQuantMixed.from_mixed(w), **var.get_metadata())
            done[f"gemv_q:{'+'.join(w.types)}"] += 1
        elif GemvQuant.error(w) is None:
            module.kernel = QuantParam(GemvQuant.from_weight(w), **var.get_metadata())
            done[f"gemv_q:{w.name}"] += 1
    return dict(done)


def norms_in_place(model) -> dict[str, int]:
    """Convert, in place, every RMSNorm scale [L, D] of the decoder's layer stacks into a StackedVector
    (surojax.models.layers.stacked_vector) that the layer scan hands over whole: the decode kernels read their
    layer's row in place instead of the scan copying each slice out (five small copies a layer and token).
    -> {"norms_in_place": scales converted}."""
    done = 0
    for module in _stack_modules(model):
        var = getattr(module, "scale", None) if isinstance(module, RMSNorm) else None
        if isinstance(var, nnx.Param) and isinstance(w := var.get_value(), jax.Array) and w.ndim == 2:
            module.scale = nnx.Param(StackedVector(w, None), **var.get_metadata())
            done += 1
    return {"norms_in_place": done} if done else {}


def experts_in_place(model, plain: bool = True, quantised: bool = False) -> dict[str, int]:
    """Convert, in place, the expert kernels of the decoder's layer stacks that the gathered GEMV kernels read in
    place: with `plain` every plain float stack [L, E, I, O] into an ExpertStack (surojax.quant.expert_stack), with
    `quantised` every quantised stack whose format has a kernel layout into a LaidOutExperts
    (surojax.quant.expert_layout; one layer at a time). -> {"experts_in_place:<dtype or format>": converted}."""
    done: collections.Counter[str] = collections.Counter()
    for module in _stack_modules(model):
        var = getattr(module, "kernel", None) if isinstance(module, ExpertLinear) else None
        if not isinstance(var, nnx.Param):
            continue
        w = var.get_value()
        if plain and isinstance(w, jax.Array) and w.ndim == 4 and jnp.issubdtype(w.dtype, jnp.floating):
            module.kernel = QuantParam(ExpertStack.from_kernel(w), **var.get_metadata())
            done[f"experts_in_place:{jnp.dtype(w.dtype).name}"] += 1
        elif quantised and isinstance(w, QuantFormat) and LaidOutExperts.error(w) is None:
            module.kernel = QuantParam(LaidOutExperts.from_stack(w), **var.get_metadata())
            done[f"experts_in_place:{w.name}"] += 1
    return dict(done)


def decode_weights(model, join_projections: bool = True) -> dict[str, int]:
    """Make the model's weights what a decode step reads best, in place, once after loading (what `surojax
    serve` (build_server) and `surojax generate` run):
    - first, where SUROJAX_DECODE_GEMV resolves to the decode GEMV kernel (pallas_kernels.decode_gemv.api.converts),
      the plain Linear kernels go transposed into GemvWeights for it (`transpose_for_gemv`), a tied head (the
      embedding, already [V, D]) is marked for it (`Decoder.head_gemv`) and the stacks' norm scales become
      StackedVectors its prologue reads in place (`norms_in_place`); what follows then takes only the quantised
      ones;
    - where it resolves to the quantised decode GEMV (pallas_kernels.decode_gemv.api.quant_converts), the quantised
      Linear kernels it takes become GemvQuants (`quant_for_gemv`), with the same fusions; the rest go on below;
    - the Linear kernels whose decode GEMVs take the fused kernel go into its layout: the layouts and sizes
      `decode_layouts()` names (SUROJAX_QUANT_MATMUL: under auto on a GPU those with a measured crossover
      DECODE_MAX_M, weights of DECODE_MIN_VALUES values or more);
    - where SUROJAX_MOE_GATHER_KERNEL resolves to the gathered GEMV kernel (pallas_kernels.gathered_gemv.api.
      converts), the plain expert stacks become ExpertStacks, and where it resolves to the quantised one
      (quant_converts) the quantised expert stacks become LaidOutExperts (`experts_in_place`): read in place at
      decode;
    - join_projections: then q / k / v and gate / up become one GEMM each where their kernels can be joined
      (surojax.models.fused_projections). Off where LoRA slots will wrap the parts by name.
    Idempotent. -> {layout: kernels converted}."""
    settings = kernel_settings()
    done = {**transpose_for_gemv(model), **norms_in_place(model)} if gemv_converts(settings.decode_gemv.value) else {}
    if quant_converts_gemv(settings.decode_gemv.value):
        done.update(quant_for_gemv(model))
    if gemv_converts(settings.decode_gemv.value) and getattr(model, "lm_head", True) is None \
            and hasattr(model, "head_gemv"):
        model.head_gemv = True  # the tied head [V, D] is the kernel's layout as it is (Decoder.logits)
        log.info("decode kernels: the tied LM head through the decode GEMV at few rows")
    gather_mode = settings.moe_gather_kernel.value
    if gathered_converts(gather_mode) or quant_converts(gather_mode):
        done.update(experts_in_place(model, plain=gathered_converts(gather_mode),
                                     quantised=quant_converts(gather_mode)))
    layouts, min_values = decode_layouts(settings.quant_matmul.value)
    done.update(lay_out_model(model, layouts, min_values))
    if done:
        log.info("decode kernels: weights laid out once for the fused decode GEMV: %s",
                 ", ".join(f"{k} x{v}" for k, v in sorted(done.items())))
    if join_projections:
        fuse_projections(model)
    return done


__all__ = ["GEMV_DTYPES", "LaidOut", "LaidOutMixed", "decode_weights", "experts_in_place", "lay_out", "lay_out_mixed",
           "lay_out_model", "norms_in_place",
           "quant_for_gemv", "transpose_for_gemv"]
