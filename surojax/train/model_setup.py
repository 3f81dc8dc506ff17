"""From a RunSpec to the model a run trains: load or build, and the run's transforms (surojax.models.transform),
made from the spec's typed sections, in the documented order:

    quantized_base  QuantizedBase (quant/model.py)        spec.quant: QLoRA's frozen base quantised
    lora            LoraTransform (peft/lora_transform.py) spec.lora: adapters; what trains is the adapters
    fp8 | nvfp4     Fp8Transform (precision/fp8_recipe.py), Nvfp4Transform (precision/nvfp4_transform.py): the
                    transform of spec.precision.recipe (`PRECISION_TRANSFORMS`)
    moe             MoeTransform (peft/moe_training.py)   spec.moe: capacity, router training, expert placement
    placement       Placement (offload/placement.py)      where the weights live (given a mesh)

(`build_run` adds the layer loop.) A `.gguf` model source keeps its quantised kernels in their GGUF format
(surojax.weights.gguf_checkpoint); its architecture comes from its metadata (run_spec.hf_config_of). A
pre-quantised HF checkpoint keeps its kernels in the surojax format that holds them (surojax.weights.prequant);
`qlora:` over it must name that format (run_spec.quant_spec).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import jax
from flax import nnx

from surojax.models.decoder import Decoder, vision_filter
from surojax.data.vision_data import VISION_MODEL_TYPES
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.tower import VisionTower
from surojax.models.transform import Transform, apply_transforms, trainable_filter as transforms_filter
from surojax.offload.placement import Placement
from surojax.peft.lora_transform import LoraTransform
from surojax.peft.moe_training import MoeTransform
from surojax.precision.fp8_recipe import Fp8Transform
from surojax.precision.nvfp4_transform import Nvfp4Transform
from surojax.precision.recipe import Recipe
from surojax.quant.model import QuantizedBase, is_quantized
from surojax.train.run_spec import RunSpec, TrainSetupError
from surojax.model_loader import load_base
from surojax.weights.model_ref import resolve_model

log = logging.getLogger(__name__)

PRECISION_TRANSFORMS: dict[Recipe, Callable[[RunSpec], Transform]] = {
    Recipe.FP8_HYBRID: lambda spec: Fp8Transform(
        spec.precision.fp8, frozen_base=spec.lora is not None, skip_first=spec.precision.skip_first_layers,
        skip_last=spec.precision.skip_last_layers, compute_dtype=spec.precision.compute),
    Recipe.NVFP4: lambda spec: Nvfp4Transform(
        frozen_base=spec.lora is not None, seed=spec.model.seed, skip_first=spec.precision.skip_first_layers,
        skip_last=spec.precision.skip_last_layers),
}


def model_transforms(spec: RunSpec, mesh=None) -> list[Transform]:
    """The transforms of `spec` up to the placement, in order (module docstring); `mesh`: MoE layers are placed
    expert-parallel on it (None: built without a mesh)."""
    out: list[Transform] = []
    if spec.quant is not None:
        out.append(QuantizedBase(spec.quant.format, dict(spec.quant.options), mix=spec.quant.is_mix))
    if spec.lora is not None:
        lo, a = spec.lora, spec.lora.adapter
        out.append(LoraTransform(rank=a.rank, alpha=a.alpha, targets=a.targets, dropout=a.dropout,
                                 use_rslora=a.use_rslora, seed=spec.model.seed + 1, dtype=spec.precision.adapter,
                                 adapter_path=lo.adapter_path, adapter_init_mode=lo.adapter_init_mode,
                                 vision=spec.model.train_vision))
    recipe = PRECISION_TRANSFORMS.get(spec.precision.recipe)
    if recipe is not None:
        out.append(recipe(spec))
    if spec.moe is not None:
        out.append(MoeTransform(capacity_factor=spec.moe.capacity_factor, train_router=spec.moe.train_router,
                                router_dtype=spec.precision.adapter, mesh=mesh))
    return out


def run_transforms(spec: RunSpec, mesh) -> list[Transform]:
    """`model_transforms` and the placement on `mesh` (build_run adds the layer loop)."""
    mem = spec.memory
    return [*model_transforms(spec, mesh),
            Placement(mesh, init=spec.model.init, offload_base=mem.offload_base, prefetch=mem.offload_prefetch,
                      offload_master=mem.offload_master, seed=spec.model.seed, load_sharded=spec.quant is None)]


def apply_model_transforms(model: Decoder, transforms: list[Transform]) -> None:
    """`apply_transforms`, a transform's ValueError (what cannot be done to this model) as a TrainSetupError."""
    try:
        apply_transforms(model, transforms)
    except ValueError as e:
        raise TrainSetupError(str(e)) from None


def build_model(spec: RunSpec, *, shardings_of: Callable[[nnx.State], nnx.State] | None = None,
                transforms: list[Transform] | None = None) -> Decoder:
    """The model of `spec`: loaded from `spec.model.source` (or initialised from its seed), then its transforms
    (default `model_transforms(spec)`) applied in order. shardings_of: a loaded HF base made straight into these
    shardings (`load_base_model`)."""
    m, prec = spec.model, spec.precision
    if m.source is None:
        model = Decoder(m.config, dtype=prec.compute, param_dtype=prec.base, attention=m.attention,
                        rngs=nnx.Rngs(params=m.seed))
        vision = m.config.hf_extra.get("vision_config")
        if vision is not None and m.config.model_type in VISION_MODEL_TYPES:  # a VLM's tower, initialised too
            model.visual = VisionTower(VisionConfig.from_hf(vision, m.config.model_type), param_dtype=prec.base,
                                       rngs=nnx.Rngs(params=m.seed + 1))
        log.info("initialised %s from scratch (seed %d)", m.config.model_type, m.seed)
    else:
        model = load_base_model(spec, shardings_of=shardings_of)
    set_vision_training(model, spec)
    apply_model_transforms(model, model_transforms(spec) if transforms is None else transforms)
    return model


def trainable_filter(spec: RunSpec, transforms: list[Transform] | None = None):
    """What the step updates: the union of the transforms' filters (models/transform.py; default
    `model_transforms(spec)`): the adapters for LoRA, every weight otherwise; with fp8_scaling: delayed also the FP8
    amax probes and histories (the step rolls them; the optimizer never sees them). A vision-language model's tower
    is left out (frozen) unless `spec.model.train_vision` (with LoRA: the tower's adapters, peft/vision_lora.py)."""
    trains = transforms_filter(model_transforms(spec) if transforms is None else transforms)
    return trains if spec.model.train_vision else nnx.All(trains, nnx.Not(vision_filter))


def set_vision_training(model: Decoder, spec: RunSpec) -> None:
    """A vision-language model's tower: trained (`train_vision`: gradients flow through it), or frozen: stored in
    the compute dtype (the dtype it runs in; no fp32 copy of frozen weights) and run under stop_gradient. With
    LoRA, `train_vision` trains the tower's adapters (LoraTransform adds them): its own weights are a frozen base,
    stored in the compute dtype as when frozen, and the gradients flow through it to the adapters."""
    if model.visual is None:
        return
    model.train_vision = spec.model.train_vision
    if not spec.model.train_vision or spec.lora is not None:
        params = nnx.state(model.visual, nnx.Param)
        nnx.update(model.visual, jax.tree.map(lambda x: x.astype(spec.precision.compute), params))


def load_base_model(spec: RunSpec, *, shardings_of: Callable[[nnx.State], nnx.State] | None = None) -> Decoder:
    """The weights of `spec.model.source` through the one model loader; a .gguf base, and a pre-quantised HF
    checkpoint (FP8, NVFP4, bitsandbytes NF4: surojax.weights.prequant), keep their quantised Linear kernels in
    their format (LoRA only); published MXFP4 experts stay packed or are dequantised as `spec.model.packed_experts`
    decided (the start-up summary's `base` line). shardings_of: an HF base's parameters made straight into these
    shardings, each process reading its part (surojax.weights.hf_checkpoint.load_model)."""
    m = spec.model
    keep = m.packed_experts.keep if m.packed_experts is not None else True
    model, _ = load_base(resolve_model(m.source), dtype=spec.precision.compute, param_dtype=spec.precision.base,
                         attention=m.attention, cfg=m.config, keep_quantized=keep, shardings_of=shardings_of)
    quantized = is_quantized(model)
    if quantized and spec.lora is None:
        kinds = ", ".join(sorted(set(quantized.values())))
        raise TrainSetupError(f"model: {m.source} holds quantized weights ({kinds}); full fine-tuning over a "
                              "quantized base is not possible: set lora: true")
    if quantized and spec.lora.merge_adapter:
        kinds = ", ".join(sorted(set(quantized.values())))
        raise TrainSetupError(f"merge_adapter cannot fold the adapter into a quantized base ({kinds}); train "
                              "without it, then merge the saved adapter into the unquantized HF model")
    if m.is_gguf:
        log.info("loaded GGUF base %s (quantized kernels: %s)", m.source, quantized or "none")
    return model
