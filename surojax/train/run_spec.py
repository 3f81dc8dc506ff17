"""The typed, frozen description of a training run, made once from a TrainConfig, read by `build_run`.

    RunSpec
      model      ModelSpec      architecture (resolved ModelConfig), where the weights come from, attention backend,
                                what happens to experts the checkpoint publishes quantised (PackedExperts)
      precision  PrecisionSpec  recipe and the dtypes it implies (compute, frozen base / master, adapters)
      lora       LoraTraining|None  adapters on a frozen base (None: every weight trains)
      quant      QuantSpec|None the frozen base quantised to this format (QLoRA)
      memory     MemorySpec     recompute, layer unrolling, lm-head chunks, what lives in host memory
      optim      OptimSpec      optimizer, learning-rate schedule over `total_steps`, clipping
      batch      BatchSpec      rows per device per micro-batch, accumulation, sequence length
      moe        MoETraining|None  router losses, expert capacity, router training (None: a dense model)
      pipeline   PipelineSpec   microbatches and repeats of the pipeline schedule (read when the mesh has stage > 1)
      zero_stage int|None       ZeRO stage over the data devices (surojax/parallel/zero.py; None: the mesh's)

`run_spec(cfg, ...)` is the only place that reads training keys into specs; everything below (`build_run`, the
model set-up, the bench, later trainers) reads the specs, never a config object. The checks that need the model
at hand (a key that cannot apply to it) run here, before any weight is loaded.

Precision recipes (`recipe`):
    fp32        everything fp32 (exact CPU tests)
    bf16        bf16 compute (matmul operands), fp32 accumulation. Full fine-tuning keeps `master_dtype` (fp32)
                weights cast at each use; LoRA keeps the frozen base in bf16 and the adapters in `lora_dtype`.
    fp8_hybrid  bf16 as above, and the decoder's Linear layers multiply in FP8 (surojax.precision)
    nvfp4       bf16 as above, and the decoder's Linear layers run the NVFP4 recipe (E2M1 + E4M3 block scales,
                16x16 weight tiles, RHT on the Wgrad inputs, stochastic rounding of gradients), emulated by bf16 GEMMs
                on exactly quantised operands; ~15 % of the layers stay bf16 (surojax.precision.nvfp4_transform)
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Literal

import jax.numpy as jnp

from surojax.config.lora import GGUF_MIXES, GGUF_TYPES as CONFIG_GGUF_TYPES
from surojax.config.schema import TrainConfig
from surojax.losses.router import RouterLossWeights
from surojax.models.config import ModelConfig
from surojax.models.layer_runner import Recompute
from surojax.models.layers.attention_backend import AttentionBackend, parse_attention_backend
from surojax.parallel.pipeline import PipelineSpec
from surojax.quant import FORMATS, GGUF_TYPES
from surojax.peft.peft_io import LoraSpec
from surojax.precision.fp8_scaling import Fp8Scaling, Fp8Settings
from surojax.precision.recipe import RECIPES, Recipe
from surojax.weights.model_ref import ModelRef, hf_config_of, names_gguf, resolve_model
from surojax.weights.prequant import QuantScheme, read_scheme
from surojax.weights.safetensors_file import WeightsError

log = logging.getLogger(__name__)

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


class TrainSetupError(ValueError):
    is_user_error = True


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """A checkpoint that publishes its experts quantised (gpt-oss: config.json `quantization_config.quant_method:
    mxfp4`) and what the run does with them: `keep` them packed in `format` (a surojax.quant format) as the frozen
    base, or dequantise them to the base dtype at load because `why` needs float experts (full fine-tuning trains
    them; merging an adapter folds into them; qlora quantises the base again)."""

    format: str
    keep: bool
    why: str

    @property
    def bytes_per_value(self) -> float:
        return FORMATS[self.format].bytes_per_value()

    def describe(self, base_dtype) -> str:
        if self.keep:
            return (f"experts kept packed in {self.format.upper()} ({8 * self.bytes_per_value:g} bits per value) as "
                    f"the {self.why}")
        return f"experts {self.format.upper()} dequantised to {jnp.dtype(base_dtype).name} at load: {self.why}"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    config: ModelConfig
    source: str | None  # a model reference to load (HF folder, .gguf file, repo id); None: random weights
    seed: int
    attention: AttentionBackend  # the attention backend the layers are built with
    init: Literal["build", "jit", "host"] = "build"
    """build: load `source` (or initialise eagerly from `seed`); jit: random weights computed on the devices inside
    one jit (a model as large as the devices allow); host: random values made on the host and placed where they
    live (a streamed base never whole on the device)."""
    packed_experts: PackedExperts | None = None  # `source` publishes its experts quantised (gpt-oss's MXFP4)
    prequantized: str | None = None  # `source` is a pre-quantised checkpoint: the format its Linear kernels load in
    # a vision-language model's tower (Decoder.visual) trains (train_vision); False: frozen, stored and run in the
    # compute dtype without gradients, left out of the trainable state (decoder.vision_filter)
    train_vision: bool = False

    @property
    def is_gguf(self) -> bool:
        return names_gguf(self.source)


@dataclasses.dataclass(frozen=True)
class PrecisionSpec:
    recipe: Recipe  # what its transform does (train/model_setup.PRECISION_TRANSFORMS); typed here from the config
    compute: Any  # activation / matmul operand dtype
    base: Any  # storage of the frozen (LoRA) or master (full) weights
    adapter: Any  # storage of LoRA adapters
    skip_first_layers: int | None = 0  # fp8_hybrid / nvfp4: layers kept in bf16 (None: the recipe's default:
    # none for fp8_hybrid, nvfp4_transform.bf16_layers' rule for nvfp4)
    skip_last_layers: int | None = 0
    fp8: Fp8Settings = Fp8Settings()  # fp8_hybrid: fp8_scaling, fp8_amax_history, fp8_amax_compute_algo

    @property
    def save_dtype(self):
        """The dtype exported weights are written in."""
        return self.recipe.compute_dtype


@dataclasses.dataclass(frozen=True)
class LoraTraining:
    adapter: LoraSpec  # the trained adapter's shape and scale (what adapter_config.json records)
    adapter_path: str | None = None  # an existing PEFT adapter to stack on
    adapter_init_mode: str | None = None  # merge | trainable
    merge_adapter: bool = False  # also export the merged model


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    format: str  # a surojax.quant format name (nf4, fp8, nvfp4, q4_k, ...) or a llama.cpp mix (q4_k_m ...)
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def is_mix(self) -> bool:
        return self.format in GGUF_MIXES


@dataclasses.dataclass(frozen=True)
class MemorySpec:
    recompute: Recompute | None = Recompute.FULL  # None: auto (build.resolve_layer_loop picks it)
    unroll: int | bool | str = 1  # layers per scan iteration, True: all, "auto"
    lmhead_chunks: int = 1
    offload_base: bool = False
    offload_prefetch: bool = False
    offload_optimizer: bool = False
    offload_master: bool = False
    optimizer_layerwise: bool = False  # full fine-tuning's in-place per-layer update on the device

    @property
    def host_memory(self) -> bool:
        """Whether anything lives in host memory (the GPU client's pinned-host cap must be raised first)."""
        return (self.offload_base or self.offload_optimizer or self.offload_master
                or self.recompute is Recompute.OFFLOAD)


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    name: str = "adamw"
    learning_rate: float = 2e-4
    schedule: str = "cosine"
    total_steps: int = 1
    warmup_steps: int = 0
    final_lr_fraction: float = 0.0
    cooldown_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    loss_guard: bool = False  # the lr scale of auto_lr_reduction applies; a non-finite step changes nothing


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    rows: int  # rows per device per micro-batch
    accumulation: int
    sequence_len: int
    image_patches: int = 0  # the most image patches of a micro-batch (its bucket; the memory plan's vision term)
    image_frame_patches: int = 0  # the most patches of one image frame (its attention rows; 0: unknown)


@dataclasses.dataclass(frozen=True)
class MoETraining:
    """How a mixture-of-experts model trains (surojax.losses.router, surojax.peft.trained_router)."""

    router_loss: RouterLossWeights  # the load-balancing and z-loss coefficients of the training loss
    capacity_factor: float | None = None  # MoE.capacity_factor of every layer; None: dropless
    train_router: bool = False  # LoRA: the router kernels train too (a full fine-tune trains them anyway)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    model: ModelSpec
    precision: PrecisionSpec
    lora: LoraTraining | None
    quant: QuantSpec | None
    memory: MemorySpec
    optim: OptimSpec
    batch: BatchSpec
    moe: MoETraining | None = None
    pipeline: PipelineSpec = PipelineSpec()
    zero_stage: int | None = None  # ZeRO stage over the data devices (config/zero.py); None: what the mesh does

    def replace(self, **sections) -> RunSpec:
        return dataclasses.replace(self, **sections)

    @property
    def base_kernel_format(self) -> str | None:
        """The surojax.quant format the frozen base's Linear kernels stay in (qlora's, or a pre-quantised
        checkpoint's own), None where they are in the base dtype (or a llama.cpp mix of several types)."""
        if self.lora is None:
            return None
        if self.quant is not None:
            return None if self.quant.is_mix else self.quant.format
        return self.model.prequantized


# ---- from a TrainConfig ---------------------------------------------------------------------------------------

def model_ref_of(cfg: TrainConfig) -> ModelRef | None:
    """`model` resolved by the one model loader (HF folder, .gguf file, a run's output folder, a cached repo id);
    a LoRA adapter is not a base to train on: it is refused with the keys to use instead."""
    if not cfg.model:
        return None
    try:
        ref = resolve_model(cfg.model, weights=False)  # a Hub id's weights are fetched when loaded
    except WeightsError as e:
        raise TrainSetupError(f"model: {e}") from None
    if ref.adapter is not None:
        raise TrainSetupError(f"model: {cfg.model} is a LoRA adapter over {ref.weights}; train on its base with "
                              f"model: {ref.weights} and adapter_path: {ref.adapter}")
    return ref


def model_config_for(cfg: TrainConfig) -> ModelConfig:
    """The architecture: the model's config.json, updated by `model_config` (from_scratch), `rope_scaling` and
    `max_model_len`; `model_type`, when set, must name the model's family."""
    ref = model_ref_of(cfg)
    hf = hf_config_of(ref) if ref is not None else {}
    hf.update(cfg.model_config_overrides or {})
    if cfg.model_type is not None:
        check_model_type(cfg.model_type, hf.get("model_type"), cfg.model or "model_config")
    if isinstance(cfg.rope_scaling, str):
        hf["rope_scaling"] = rope_scaling_for(cfg.rope_scaling, cfg.max_model_len, hf)
        hf.pop("rope_parameters", None)
    elif cfg.rope_scaling:
        rs = dict(cfg.rope_scaling)
        kind = rs.get("rope_type", rs.get("type"))
        if cfg.max_model_len and kind in ("yarn", "llama3") and "original_max_position_embeddings" not in rs \
                and "original_max_position_embeddings" not in hf and hf.get("max_position_embeddings"):
            # the context the factor stretches is the model's own, not max_model_len (set below)
            rs["original_max_position_embeddings"] = hf["max_position_embeddings"]
        theta = (hf.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None and "rope_theta" not in rs and "rope_theta" not in hf:  # transformers 5 keeps it there
            rs["rope_theta"] = theta
        hf["rope_scaling"] = rs
        hf.pop("rope_parameters", None)
    if cfg.max_model_len:
        hf["max_position_embeddings"] = cfg.max_model_len
    try:
        return ModelConfig.from_hf(hf)
    except ValueError as e:
        raise TrainSetupError(f"model_config: {e}") from None


# Surogate's model-type names that are not transformers' (config.json's model_type)
MODEL_TYPE_NAMES = {"qwen2_5": "qwen2", "qwen2_5_vl": "qwen2_5_vl"}


def check_model_type(expected: str, actual: str | None, model: str) -> None:
    """`model_type: expected` names config.json's model_type, or its family as a prefix (qwen: qwen2, qwen3,
    qwen3_moe; qwen3: qwen3_moe). Anything else is refused before data and weights are read."""
    want = MODEL_TYPE_NAMES.get(expected.lower(), expected.lower())
    if actual is None or not actual.lower().startswith(want):
        raise TrainSetupError(f"model_type: {expected!r} does not match {model}, whose config.json says model_type "
                              f"{actual!r}; remove the key (it is read from the model) or fix it")


def rope_scaling_for(rope_type: str, max_model_len: int | None, hf: dict) -> dict:
    """`rope_scaling: linear | yarn` with `max_model_len` (Surogate's spelling): the factor that stretches the
    model's original context to max_model_len, ceil(max_model_len / original), at least 1; the original context is
    the model's own rope_scaling's original_max_position_embeddings, else its max_position_embeddings (divided by
    its own rope_scaling's factor when it has one), as Surogate's ModelConfig computes it."""
    if max_model_len is None:
        raise TrainSetupError(f"rope_scaling: {rope_type} takes its factor from max_model_len (the context to "
                              "reach): set max_model_len, or give rope_scaling as a dict with its factor")
    own = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    original = own.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not original and hf.get("max_position_embeddings"):  # a model already scaled by `factor` (Surogate's rule)
        scaled = own.get("rope_type", own.get("type", "default")) != "default" and own.get("factor")
        original = hf["max_position_embeddings"] // scaled if scaled else hf["max_position_embeddings"]
    if not original:
        raise TrainSetupError(f"rope_scaling: {rope_type}: the model's config.json has no max_position_embeddings "
                              "to scale from; give rope_scaling as a dict with factor and "
                              "original_max_position_embeddings")
    factor = max(float(math.ceil(max_model_len / original)), 1.0)
    out = {"rope_type": rope_type, "factor": factor}
    if rope_type == "yarn":
        out["original_max_position_embeddings"] = int(original)
    theta = own.get("rope_theta")
    return out | ({"rope_theta": theta} if theta is not None else {})


def precision_spec(cfg: TrainConfig) -> PrecisionSpec:
    """The config's `recipe` and `fp8_scaling` strings become `Recipe` and `Fp8Scaling` here, once."""
    if cfg.recipe not in RECIPES:
        raise TrainSetupError(f"recipe: {cfg.recipe} is not available in this version (use {', '.join(RECIPES)})")
    recipe = Recipe(cfg.recipe)
    if recipe is Recipe.FP32:
        return PrecisionSpec(recipe, jnp.float32, jnp.float32, jnp.float32)
    base = jnp.bfloat16 if cfg.lora else DTYPES[cfg.master_dtype]
    first, last = cfg.skip_quant_first_layers, cfg.skip_quant_last_layers  # None: the recipe's transform's rule
    fp8 = Fp8Settings(Fp8Scaling(cfg.resolved_fp8_scaling), cfg.fp8_amax_history, cfg.fp8_amax_compute_algo)
    return PrecisionSpec(recipe, recipe.compute_dtype, base, DTYPES[cfg.lora_dtype], first, last, fp8)


def train_vision(cfg: TrainConfig, model_cfg: ModelConfig) -> bool:
    """`train_vision: true` read against the model: it needs a vision tower (config.json's vision_config)."""
    if cfg.train_vision and "vision_config" not in model_cfg.hf_extra:
        raise TrainSetupError(f"train_vision: {model_cfg.model_type} has no vision tower (config.json has no "
                              "vision_config); remove the key")
    return bool(cfg.train_vision)


def lora_training(cfg: TrainConfig) -> LoraTraining | None:
    if not cfg.lora:
        return None
    adapter = LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=tuple(cfg.lora_target_modules),
                       dropout=cfg.lora_dropout, use_rslora=cfg.use_rslora)
    return LoraTraining(adapter, adapter_path=cfg.adapter_path, adapter_init_mode=cfg.adapter_init_mode,
                        merge_adapter=cfg.merge_adapter)


def quant_spec(cfg: TrainConfig, prequant: QuantScheme | None = None) -> QuantSpec | None:
    """The quantised-base format asked by `qlora` (or its spellings qlora_bnb / qlora_fp8 / qlora_fp4 /
    qlora_gguf). Raises TrainSetupError for what cannot be done (yet). prequant: the loaded `model` is a
    pre-quantised checkpoint (`check_prequantized_base`): its own format is the base's, nothing is quantised."""
    fmt = cfg.qlora
    if prequant is not None:
        if fmt is not None:
            log.info("qlora: %s: model %s is stored as %s already (%s); its own quantisation is the frozen base, "
                     "nothing is re-quantised", cfg.qlora, cfg.model, prequant.format, prequant.describe())
        return None
    if fmt is None:
        return None
    options: tuple = ()
    if fmt == "nf4":
        options = (("double_quant", bool(cfg.qlora_bnb_double_quant)),)
    elif fmt not in ("fp8", "nvfp4") and fmt not in GGUF_MIXES:
        cls = GGUF_TYPES.get(fmt)
        if cls is None or not cls.can_quantize:
            ok = [t for t in CONFIG_GGUF_TYPES if t in GGUF_TYPES and GGUF_TYPES[t].can_quantize]
            raise TrainSetupError(f"qlora_gguf: {fmt} cannot be quantised to yet (no quantiser for it in this "
                                  f"version); types that work: {', '.join(ok)}")
    if not cfg.lora:
        raise TrainSetupError("qlora quantizes the frozen base for LoRA; full fine-tuning over a quantized base is "
                              "not possible: set lora: true")
    if names_gguf(cfg.model):
        raise TrainSetupError(f"qlora: model: {cfg.model} is a GGUF file, which keeps its own quantization; "
                              "remove the qlora key (or start from the HF model folder)")
    return QuantSpec(fmt, options)


def prequantized_base(cfg: TrainConfig) -> QuantScheme | None:
    """The reader of `model` when it is a pre-quantised HF checkpoint (surojax.weights.prequant: FP8, NVFP4,
    bitsandbytes NF4), else None. Its quantised Linear kernels are the frozen base of LoRA as stored."""
    ref = model_ref_of(cfg)
    if ref is None or ref.kind != "hf":
        return None
    try:
        return read_scheme(ref.weights)
    except WeightsError as e:
        raise TrainSetupError(f"model: {e}") from None


def check_prequantized_base(cfg: TrainConfig) -> QuantScheme | None:
    """`prequantized_base`, after refusing what cannot run over such a base: full fine-tuning, merge_adapter and
    adapter_init_mode merge (an adapter cannot be folded into quantised weights), a `qlora` of another format. It
    reads config files only, so the Trainer calls it before its data (and run_spec again)."""
    prequant = prequantized_base(cfg)
    if prequant is None:
        return None
    if not cfg.lora:
        raise TrainSetupError(f"model: {cfg.model} is pre-quantised ({prequant.describe()}); full fine-tuning "
                              "over a quantized base is not possible: set lora: true")
    if cfg.merge_adapter:
        raise TrainSetupError(
            f"merge_adapter: model: {cfg.model} is pre-quantised ({prequant.describe()}); the adapter cannot be "
            "folded into its quantised weights. Train without merge_adapter, then run surojax merge --base-model "
            f"{cfg.model} --checkpoint-dir {cfg.output_dir} --output DIR (it dequantises the base)")
    if cfg.adapter_path and (cfg.adapter_init_mode or "merge") == "merge":
        raise TrainSetupError(
            f"adapter_init_mode: merge: model: {cfg.model} is pre-quantised ({prequant.describe()}); "
            f"{cfg.adapter_path} cannot be folded into its quantised weights. Use adapter_init_mode: trainable (the "
            "adapter trains on), or merge it into the unquantised model first")
    if cfg.qlora is not None:
        _check_qlora_matches(cfg, prequant)
    return prequant


def _check_qlora_matches(cfg: TrainConfig, prequant: QuantScheme) -> None:
    """`qlora` over a pre-quantised base: the same format is the checkpoint's own (nothing is re-quantised);
    another format would round every weight a second time, so it is refused."""
    if cfg.qlora != prequant.format:
        raise TrainSetupError(
            f"qlora: {cfg.qlora}: model: {cfg.model} is already quantised ({prequant.describe()}); quantising it "
            f"again to {cfg.qlora} would round every weight a second time. Remove qlora (lora: true trains LoRA "
            f"over the checkpoint's own {prequant.format} weights) or start from the unquantised model")
    stored = getattr(prequant, "double_quant", None)
    if cfg.qlora == "nf4" and "qlora_bnb_double_quant" in cfg.model_fields_set and stored != cfg.qlora_bnb_double_quant:
        raise TrainSetupError(
            f"qlora_bnb_double_quant: {cfg.qlora_bnb_double_quant}: model: {cfg.model} is stored as NF4 "
            f"{'with' if stored else 'without'} double quantisation (its config.json bnb_4bit_use_double_quant), "
            "which is used as stored; remove the key")


def memory_spec(cfg: TrainConfig) -> MemorySpec:
    # `recompute: auto` becomes None (resolved by the memory plan in build.resolve_layer_loop); the rest typed
    recompute = None if cfg.recompute == "auto" else Recompute.parse(cfg.recompute)
    return MemorySpec(recompute=recompute, unroll=cfg.unroll_layers, lmhead_chunks=cfg.lmhead_chunks,
                      offload_base=cfg.offload_base_weights, offload_prefetch=cfg.offload_prefetch,
                      offload_optimizer=cfg.offload_optimizer, offload_master=cfg.offload_master,
                      optimizer_layerwise=cfg.optimizer_layerwise)


def optim_spec(cfg: TrainConfig, total_steps: int) -> OptimSpec:
    return OptimSpec(name=cfg.optimizer, learning_rate=cfg.learning_rate, schedule=cfg.lr_scheduler_type,
                     total_steps=total_steps, warmup_steps=cfg.warmup_steps_for(total_steps),
                     final_lr_fraction=cfg.final_lr_fraction, cooldown_steps=cfg.cooldown_steps or 0,
                     weight_decay=cfg.weight_decay, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                     max_grad_norm=cfg.max_grad_norm, loss_guard=cfg.auto_lr_reduction)


MOE_KEYS = ("router_aux_loss_coef", "router_z_loss_coef", "capacity_factor", "train_router")


def moe_training(cfg: TrainConfig, model_cfg: ModelConfig) -> MoETraining | None:
    """The MoE keys read against the model. The aux coefficient defaults to its config.json's
    `router_aux_loss_coef` where the load-balancing term has a purpose: the router trains (`train_router`, or a
    full fine-tune) or config.json asks for it (`output_router_logits: true`, transformers' own switch); else 0,
    so a LoRA run's loss is transformers' loss. On a dense model a MoE key set away from its default is refused
    (there is no router)."""
    if model_cfg.moe is None:
        fields = type(cfg).model_fields
        set_keys = [k for k in MOE_KEYS if getattr(cfg, k) != fields[k].get_default(call_default_factory=True)]
        if set_keys:
            raise TrainSetupError(f"{set_keys[0]}: applies to mixture-of-experts models only; "
                                  f"{model_cfg.model_type} is dense (no router): remove the key")
        return None
    if cfg.offload_prefetch:
        raise TrainSetupError("offload_prefetch: its layer loop does not collect the router statistics the MoE "
                              "training loss needs; use offload_base_weights without offload_prefetch")
    aux = cfg.router_aux_loss_coef
    if aux is None:  # transformers adds the term with output_router_logits; we also do where the router trains
        trains_router = cfg.train_router or not cfg.lora
        wanted = trains_router or bool(model_cfg.hf_extra.get("output_router_logits"))
        aux = model_cfg.moe.router_aux_loss_coef if wanted else 0.0
    return MoETraining(RouterLossWeights(aux_coef=aux, z_coef=cfg.router_z_loss_coef),
                       capacity_factor=cfg.capacity_factor, train_router=cfg.train_router)


def packed_experts(cfg: TrainConfig, model_cfg: ModelConfig) -> PackedExperts | None:
    """What the run does with experts its checkpoint publishes in MXFP4 (None: the checkpoint's experts are float):
    kept packed where they stay frozen (LoRA, nothing folded into them), else dequantised (PackedExperts.why)."""
    qc = model_cfg.hf_extra.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "mxfp4":
        return None
    if not cfg.lora:
        why = "full fine-tuning trains them"
    elif cfg.merge_adapter:
        why = "merge_adapter folds the adapter into them"
    elif cfg.adapter_path and (cfg.adapter_init_mode or "merge") == "merge":
        why = "adapter_init_mode merge folds adapter_path into them"
    elif cfg.qlora is not None:
        why = f"qlora {cfg.qlora} quantises the base again"
    else:
        return PackedExperts("mxfp4", True, "frozen LoRA base")
    return PackedExperts("mxfp4", False, why)


def attention_backend(cfg: TrainConfig) -> AttentionBackend:
    """The `attention` key as the typed backend (the one parse of its spelling)."""
    try:
        return parse_attention_backend(cfg.attention)
    except ValueError as e:
        raise TrainSetupError(str(e)) from None


def run_spec(cfg: TrainConfig, *, total_steps: int, attention: AttentionBackend | None = None,
             init: Literal["build", "jit", "host"] = "build", model_config: ModelConfig | None = None) -> RunSpec:
    """The run a TrainConfig describes. attention: the backend the layers are built with (default
    `cfg.attention`; the Trainer passes `packed_backend` of its data). init: "build" loads `model` (or initialises
    from the seed with from_scratch); "jit" / "host" give random weights of `model`'s architecture (benchmarks)."""
    model_cfg = model_config or model_config_for(cfg)  # the caller's, when it already read it
    precision = precision_spec(cfg)
    random_weights = cfg.from_scratch or init != "build"
    prequant = check_prequantized_base(cfg) if not random_weights and cfg.model else None
    quant = quant_spec(cfg, prequant)
    model = ModelSpec(config=model_cfg, source=None if random_weights else cfg.model, seed=cfg.seed,
                      attention=attention or attention_backend(cfg), init=init,
                      packed_experts=None if random_weights else packed_experts(cfg, model_cfg),
                      prequantized=prequant.format if prequant is not None else None,
                      train_vision=train_vision(cfg, model_cfg))
    batch = BatchSpec(rows=cfg.per_device_train_batch_size, accumulation=cfg.gradient_accumulation_steps,
                      sequence_len=cfg.sequence_len)
    return RunSpec(model=model, precision=precision, lora=lora_training(cfg), quant=quant, memory=memory_spec(cfg),
                   optim=optim_spec(cfg, total_steps), batch=batch, moe=moe_training(cfg, model_cfg),
                   pipeline=PipelineSpec(cfg.parallel.pipeline_microbatches, cfg.parallel.pipeline_repeats),
                   zero_stage=cfg.resolved_zero_stage)
