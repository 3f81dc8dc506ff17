"""Cross-field rules of TrainConfig, all in this one place. Pure: they read the config and list problems.

Each rule returns (keys, message): the YAML keys it is about (the first one is reported as the problem's key)
and a sentence saying what to change. Single-field bounds (sequence_len > 0, ...) live on the fields themselves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from surojax.config.base import differs_from_default
from surojax.config.grpo import BUILTIN_REWARDS, GRPOSection
from surojax.config.lora import QLORA_SPELLINGS, spelled_formats
from surojax.config.policy_loss import LOSS_TYPES, resolved_loss_type

if TYPE_CHECKING:
    from surojax.config.schema import TrainConfig

Problem = tuple[tuple[str, ...], str]

LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "use_rslora", "lora_target_modules", "lora_dtype",
             "merge_adapter", "train_router")
DISTILL_KEYS = ("teacher", "teacher_logprobs", "teacher_top_k", "alpha", "temperature")  # read by trainer: distill
SHARED_KEYS = {"grpo": ("temperature",), "distill": ("temperature",)}  # trainer -> keys it reads that others own too
QLORA_FORMATS = ("qlora", "qlora_bnb", "qlora_fp8", "qlora_fp4", "qlora_gguf")
DPO_KEYS = ("label_smoothing", "reference_free")  # read by trainer: dpo (beta / loss_type: config/policy_loss.py)
# read by the SFT / distill data pipeline only (data/pipeline.py): refused for trainer dpo / grpo
SFT_DATA_KEYS = ("template", "use_chat_template", "truncation_strategy", "max_length", "dataloader_num_workers")
SFT_DATASET_KEYS = ("system_field", "tools_field", "prompt_format", "prompt_format_no_input")
# accepted keys whose feature this version does not have: refused when set (key -> (is it set?, why))
NOT_AVAILABLE = {
    "optimizer": (lambda c: c.optimizer == "normuon", "normuon is not available in this version (adamw, adamw_8bit)"),
    "gradient_dtype": (lambda c: c.gradient_dtype not in (None, "fp32" if c.recipe == "fp32" else "bf16"),
                       "activation gradients in a dtype other than the recipe's are not available in this version: "
                       "the backward pass runs in bf16, in fp32 with recipe: fp32 (remove the key, or choose the "
                       "recipe); weight gradients accumulate in fp32 either way"),
    "sequence_chunks": (lambda c: c.sequence_chunks != 1, "chunking the sequence through the layers is not "
                        "available in this version (the LM head is chunked by lmhead_chunks)"),
    "long_context": (lambda c: c.long_context, "the tiled long-context MLP is not available in this version"),
    "offload_grads": (lambda c: c.offload_grads, "gradients in host memory are not available in this version "
                      "(see offload_optimizer / offload_master)"),
}


def cross_field_problems(cfg: TrainConfig) -> list[Problem]:
    out: list[Problem] = []
    add = lambda keys, msg: out.append((keys, msg))  # noqa: E731

    # --- model source
    if cfg.model is None and not (cfg.from_scratch and cfg.model_config_overrides):
        if cfg.from_scratch:
            add(("model_config", "model"), "from_scratch needs model_config (HF config keys) or a model path "
                "with a config.json")
        else:
            add(("model",), "required: a local model directory, a .gguf file, or a Hugging Face Hub id (org/name)")
    if cfg.model_config_overrides is not None and not cfg.from_scratch:
        add(("model_config",), "only applies with from_scratch: true (to change a pretrained model use "
            "rope_scaling / max_model_len)")
    if cfg.from_scratch and (cfg.adapter_path or cfg.lora):
        add(("from_scratch",), "trains all weights from random init; it cannot be combined with lora or adapter_path")

    # --- trainer kinds
    if cfg.trainer != "distill":
        shared = SHARED_KEYS.get(cfg.trainer, ())
        for k in [k for k in DISTILL_KEYS if differs_from_default(cfg, k) and k not in shared]:
            add((k,), f"is a distillation option (trainer: distill); trainer is {cfg.trainer}")
    elif cfg.teacher is None and cfg.teacher_logprobs is None:
        add(("teacher", "teacher_logprobs"), "trainer: distill needs a teacher model, or teacher_logprobs (a "
            "sidecar written by `surojax distill CONFIG --precompute`)")

    # --- keys whose feature is not in this version
    for key, (is_set, why) in NOT_AVAILABLE.items():
        if is_set(cfg):
            add((key,), why)

    # --- LoRA / QLoRA
    if not cfg.lora:
        for k in [k for k in LORA_KEYS if differs_from_default(cfg, k)]:
            add((k,), "is a LoRA option; set lora: true to use it")
    formats = [k for k in QLORA_FORMATS if getattr(cfg, k) not in (False, None)]
    chosen = {cfg.qlora} | spelled_formats({k: getattr(cfg, k) for k in QLORA_SPELLINGS})
    if len(chosen - {None}) > 1:
        add(tuple(formats), f"at most one quantised-base format may be set (got {', '.join(formats)})")
    formats = [k for k in formats if k != "qlora"] or formats  # report the key the user wrote
    if formats and not cfg.lora:
        add((formats[0],), "quantizes the frozen base for LoRA; set lora: true")
    for k in ("qlora_bnb_block_size", "qlora_bnb_double_quant"):
        if differs_from_default(cfg, k) and cfg.qlora != "nf4":
            add((k,), "only applies with qlora_bnb: true (qlora: nf4)")
    if differs_from_default(cfg, "qlora_block_size") and cfg.qlora != "fp8":
        add(("qlora_block_size",), "only applies with qlora_fp8: true (qlora: fp8)")
    if differs_from_default(cfg, "qlora_bnb_block_size") and cfg.qlora == "nf4":
        add(("qlora_bnb_block_size",), f"{cfg.qlora_bnb_block_size} is not available: NF4 uses the bitsandbytes "
            "block size 64")
    if differs_from_default(cfg, "qlora_block_size") and cfg.qlora == "fp8":
        add(("qlora_block_size",), f"{cfg.qlora_block_size} is not available: qlora fp8 uses 128 x 128 scale blocks")
    if cfg.qlora is not None and cfg.lora and cfg.merge_adapter:
        add(("merge_adapter", formats[0]), "cannot fold the adapter into a quantized base; train without it, then "
            "merge the saved adapter into the unquantized model (surojax merge)")
    if cfg.qlora is not None and cfg.adapter_path and (cfg.adapter_init_mode or "merge") == "merge":
        add(("adapter_init_mode", formats[0]), "merge cannot fold the adapter into a quantized base; use "
            "adapter_init_mode: trainable, or merge it into the unquantized model first")
    if cfg.adapter_init_mode is not None and cfg.adapter_path is None:
        add(("adapter_init_mode",), "needs adapter_path (the adapter to merge or keep training)")
    if cfg.train_vision and cfg.trainer not in ("sft", "pt"):
        add(("train_vision", "trainer"), f"the vision tower trains on image rows, which trainer: {cfg.trainer} does "
            "not read; remove train_vision")
    if cfg.adapter_init_mode == "trainable" and not cfg.lora:
        add(("adapter_init_mode",), "trainable keeps training the adapter; set lora: true")

    # --- precision
    if cfg.recipe in ("fp8_hybrid", "nvfp4") and formats:
        add(("recipe", formats[0]), f"{cfg.recipe} multiplies a bf16 base in low precision; a qlora_* base is "
            "already quantised (use recipe: bf16 with qlora_*, or drop the qlora_* key)")
    if cfg.recipe in ("fp8_hybrid", "nvfp4") and cfg.lora and cfg.merge_adapter:
        add(("merge_adapter", "recipe"), f"would fold the adapter into the quantised base of {cfg.recipe}; train "
            "without it and merge the saved adapter into the bf16 model")
    for k in ("skip_quant_first_layers", "skip_quant_last_layers"):
        if getattr(cfg, k) and cfg.recipe not in ("fp8_hybrid", "nvfp4"):  # 0 asks for nothing
            add((k,), "only applies with recipe: fp8_hybrid (or nvfp4)")
    if differs_from_default(cfg, "fp8_scaling") and cfg.recipe != "fp8_hybrid":
        add(("fp8_scaling",), "only applies with recipe: fp8_hybrid")
    for k in ("fp8_amax_history", "fp8_amax_compute_algo"):
        if differs_from_default(cfg, k) and not (cfg.recipe == "fp8_hybrid" and cfg.resolved_fp8_scaling == "delayed"):
            add((k,), f"is read by delayed scaling only (recipe: fp8_hybrid with fp8_scaling: delayed); with "
                f"fp8_scaling: {cfg.resolved_fp8_scaling} (current scaling per tensor, or blockwise per tile) each "
                "tensor is scaled by its own amax in the same step: remove the key")
    if cfg.recipe == "fp8_hybrid" and cfg.fp8_scaling == "delayed" and cfg.offload_optimizer:
        add(("fp8_scaling", "offload_optimizer"), "delayed scaling's amax histories are rolled by the training "
            "step, which offload_optimizer's in-place update bypasses: use fp8_scaling: current with it (or leave it "
            "unset: it resolves to current here)")

    # --- memory
    if cfg.offload_base_weights and not cfg.lora:
        add(("offload_base_weights",), "streams the frozen base of LoRA training; set lora: true (full fine-tuning "
            "trains every weight: see offload_master / offload_optimizer)")
    if cfg.offload_master and cfg.lora:
        add(("offload_master", "lora"), "keeps the fp32 master weights of full fine-tuning in host memory; LoRA has "
            "no master copy of the base (see offload_base_weights)")
    elif cfg.offload_master and (cfg.recipe != "bf16" or cfg.master_dtype != "fp32"):
        add(("offload_master", "recipe", "master_dtype"), "needs recipe: bf16 with master_dtype: fp32 (the device "
            "then trains the bf16 copy of fp32 master weights kept in host memory)")
    if cfg.offload_base_weights and cfg.recompute == "none":
        add(("recompute", "offload_base_weights"), "none keeps each layer's device copy of its streamed weights "
            "for the backward pass (the whole base on the device); use full, dots or offload with "
            "offload_base_weights")
    if cfg.offload_prefetch and not cfg.offload_base_weights:
        add(("offload_prefetch",), "prefetches the streamed base; set offload_base_weights: true")
    if cfg.offload_prefetch and cfg.recompute not in ("full", "auto"):
        add(("recompute", "offload_prefetch"), f"the prefetching layer loop recomputes each layer whole (full); "
            f"{cfg.recompute} is not built for it: set recompute: full")
    if cfg.offload_prefetch and cfg.eval_generation is not None:
        add(("offload_prefetch", "eval_generation"), "offload_prefetch keeps the base as per-layer host buffers "
            "that only the training step's prefetching loop reads; eval_generation decodes with a KV cache over "
            "the plain layer loop: drop one of the two")

    # --- adaptive training
    for k in ("offload_optimizer", "offload_master", "optimizer_layerwise"):
        if cfg.auto_lr_reduction and getattr(cfg, k):
            add(("auto_lr_reduction", k), f"the loss guard's learning-rate cuts and skipped steps are not available "
                f"with {k} (its update runs in place, layer by layer); drop one of the two")
    if cfg.epoch_adjustment and cfg.max_steps is not None:
        add(("epoch_adjustment", "max_steps"), "epoch_adjustment sets the number of epochs from the Chinchilla "
            "budget; it does not apply to a run of max_steps: drop one of the two")

    # --- metric sinks
    for k in ("aim_experiment", "aim_repo", "aim_name"):
        if getattr(cfg, k) is not None and "aim" not in cfg.report_to:
            add((k,), "configures the Aim sink; add aim to report_to")
    if cfg.wandb_name is not None and "wandb" not in cfg.report_to:
        add(("wandb_name",), "names the W&B run; add wandb to report_to")

    # --- length of training and schedule
    if cfg.max_steps is None and cfg.num_epochs is None:
        add(("max_steps", "num_epochs"), "set max_steps or num_epochs")
    if cfg.warmup_steps and cfg.warmup_ratio:  # 0 asks for nothing (Surogate's default: then the ratio applies)
        add(("warmup_steps", "warmup_ratio"), "set warmup_steps or warmup_ratio, not both")
    if cfg.cooldown_steps and cfg.lr_scheduler_type != "wsd":  # 0 (Surogate's default) asks for nothing
        add(("cooldown_steps",), f"only applies with lr_scheduler_type: wsd (got {cfg.lr_scheduler_type})")
    if cfg.max_steps is not None:
        warm = cfg.warmup_steps or 0
        cool = cfg.cooldown_steps or 0
        if warm + cool > cfg.max_steps:
            add(("warmup_steps",),
                f"warmup_steps + cooldown_steps ({warm} + {cool}) exceed max_steps ({cfg.max_steps})")
    if cfg.save_total_limit is not None and cfg.save_steps is None:
        add(("save_total_limit",), "needs save_steps (without it only the final model is saved)")

    # --- data
    entries = [(f"datasets.{i}", d) for i, d in enumerate(cfg.datasets)]
    entries += [(f"validation_datasets.{i}", d) for i, d in enumerate(cfg.validation_datasets)]
    entries += [("eval_generation", cfg.eval_generation)] if cfg.eval_generation is not None else []
    for where, d in entries:
        if d.prompt_field != "prompt" and cfg.trainer != "dpo":
            add((f"{where}.prompt_field",), "names the prompt column of preference rows, which only trainer: dpo "
                "reads; remove the key or set trainer: dpo")
        if cfg.trainer == "dpo" and d.type not in ("preference", "auto") and where != "eval_generation":
            add((f"{where}.type",), f"trainer: dpo trains on preference pairs; type {d.type} is not one (use "
                "type: preference)")
        if cfg.trainer != "dpo" and d.type == "preference":
            add((f"{where}.type",), "preference pairs train with trainer: dpo (`surojax dpo`); the "
                f"{cfg.trainer} trainer takes text, instruction or conversation data")
    if cfg.template is not None and cfg.chat_template is not None:
        add(("template", "chat_template"), "template names the tokenizer's own template by its family; chat_template "
            "gives another template: set one of the two")
    if cfg.max_length is not None and cfg.max_length > cfg.sequence_len:
        add(("max_length",), f"{cfg.max_length} exceeds sequence_len ({cfg.sequence_len}): a row holds at most "
            "sequence_len tokens")
    if not cfg.use_chat_template:
        for where, d in entries:
            if d.type == "conversation" and where != "eval_generation":
                add((f"{where}.type",), "conversation rows are rendered with a chat template, and "
                    "use_chat_template is false")
    if cfg.trainer in ("dpo", "grpo"):  # keys the SFT data pipeline reads (data/pipeline.py), not DPO's or GRPO's
        for k in [k for k in SFT_DATA_KEYS if differs_from_default(cfg, k)]:
            add((k,), f"is read by the SFT data pipeline; trainer: {cfg.trainer} builds its rows its own way: remove "
                "the key")
        for where, d in entries:
            for k in [k for k in SFT_DATASET_KEYS if k in d.model_fields_set]:
                add((f"{where}.{k}",), f"is read by the SFT data pipeline; trainer: {cfg.trainer} builds its rows "
                    "its own way: remove the key")
    if cfg.validation_datasets and cfg.validation_split_ratio > 0:
        add(("validation_split_ratio", "validation_datasets"), "set validation_datasets or validation_split_ratio, "
            "not both")
    if cfg.eval_steps is not None and not (cfg.validation_datasets or cfg.validation_split_ratio > 0):
        add(("eval_steps",), "needs validation data: validation_datasets or validation_split_ratio > 0")
    if cfg.max_model_len is not None and cfg.sequence_len > cfg.max_model_len:
        add(("sequence_len",), f"{cfg.sequence_len} exceeds max_model_len ({cfg.max_model_len})")

    # --- GRPO (config/grpo.py)
    if cfg.trainer != "grpo":
        shared = SHARED_KEYS.get(cfg.trainer, ())
        for k in [k for k in GRPOSection.model_fields if differs_from_default(cfg, k) and k not in shared]:
            add((k,), f"is a GRPO option; it does not apply to trainer: {cfg.trainer} (set trainer: grpo)")
    else:
        if not cfg.reward_functions:
            add(("reward_functions",), "trainer: grpo needs at least one reward function (a built-in: "
                f"{', '.join(BUILTIN_REWARDS)}, or module:function)")
        if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward_functions):
            add(("reward_weights", "reward_functions"), f"one weight per reward function: got "
                f"{len(cfg.reward_weights)} weights for {len(cfg.reward_functions)} functions")
        if cfg.format_regex is None and "format_regex" in cfg.reward_functions:
            add(("format_regex", "reward_functions"), "the format_regex reward needs the pattern: set format_regex")
        if cfg.format_regex is not None and "format_regex" not in cfg.reward_functions:
            add(("format_regex",), "is the pattern of the format_regex reward; add format_regex to reward_functions")
        if differs_from_default(cfg, "exact_match_column") and "exact_match" not in cfg.reward_functions:
            add(("exact_match_column",), "is the column of the exact_match reward; add exact_match to "
                "reward_functions")
    # --- beta / loss_type: read by dpo and grpo, each with its own defaults and loss types (config/policy_loss.py)
    for key in ("beta", "loss_type"):
        if getattr(cfg, key) is not None and cfg.trainer not in LOSS_TYPES:
            add((key,), f"applies with trainer: dpo or grpo (this run's trainer is {cfg.trainer})")
    if cfg.trainer in LOSS_TYPES and cfg.loss_type is not None and cfg.loss_type not in LOSS_TYPES[cfg.trainer]:
        add(("loss_type",), f"{cfg.loss_type!r} is not a {cfg.trainer} loss type; expected one of "
            f"{', '.join(LOSS_TYPES[cfg.trainer])}")
    if cfg.trainer == "dpo" and cfg.beta == 0:
        add(("beta",), "must be > 0 for DPO (rewards are beta x log-ratio)")

    # --- DPO
    if cfg.trainer != "dpo":
        for k in [k for k in DPO_KEYS if differs_from_default(cfg, k)]:
            add((k,), f"is a DPO option; it applies with trainer: dpo (this run's trainer is {cfg.trainer})")
    else:
        if cfg.label_smoothing and resolved_loss_type(cfg) != "sigmoid":
            add(("label_smoothing", "loss_type"), f"label smoothing (cDPO) applies to loss_type sigmoid only, not "
                f"{cfg.loss_type}")
        if cfg.train_on_inputs:
            add(("train_on_inputs",), "DPO compares the log-probs of the responses only; the prompt is never "
                "supervised: remove the key")

    # --- parallel
    par = cfg.parallel
    rest = [a for a, n in par.sizes().items() if n == -1]
    if len(rest) > 1:
        add(("parallel",), f"at most one axis may be -1 (the rest of the devices); got {', '.join(rest)}")
    if par.stage == 1:
        for k in ("pipeline_microbatches", "pipeline_repeats"):
            if getattr(par, k) != type(par).model_fields[k].default:
                add((f"parallel.{k}",), "schedules the pipeline stages; it applies with parallel.stage > 1")
    else:
        for key, why in (("offload_base_weights", "streams the base layer by layer through the plain layer loop"),
                         ("offload_prefetch", "is a layer loop of its own"),
                         ("eval_generation", "decodes with a KV cache over the plain layer scan")):
            if getattr(cfg, key) not in (False, None):
                add((key, "parallel.stage"), f"{why}; it does not run with pipeline stages (parallel.stage > 1): "
                    f"drop one of the two")
        if cfg.recipe == "fp8_hybrid" and cfg.fp8_scaling == "delayed":
            add(("fp8_scaling", "parallel.stage"), "delayed scaling reads each layer's amaxes from one pass per "
                "step; a pipeline schedule runs a layer once per microbatch (the amaxes would add up): use "
                "fp8_scaling: current with pipeline stages (or leave it unset: it resolves to current here)")

    # --- ZeRO stage (config/zero.py)
    stage = cfg.zero_stage
    if stage is not None and stage < 3 and cfg.parallel.fsdp != 1:
        add(("zero_stage", "parallel"), f"{stage} keeps the parameters whole on every data-parallel "
            f"device, but parallel.fsdp = {cfg.parallel.fsdp} shards them (that is ZeRO-3): set zero_stage: 3, or "
            "parallel.fsdp: 1 (and the devices on parallel.data)")
    if cfg.optimizer_layerwise:
        if cfg.lora:
            add(("optimizer_layerwise", "lora"), "updates full fine-tuning's stacked layers in place; LoRA's "
                "adapters are small enough for the whole-tree update: drop optimizer_layerwise")
        split = {a: getattr(cfg.parallel, a) for a in ("fsdp", "tensor", "expert", "stage")
                 if getattr(cfg.parallel, a, 1) != 1}
        if split or stage in (1, 2, 3):
            add(("optimizer_layerwise", "zero_stage" if stage in (1, 2, 3) else "parallel"), "updates whole "
                "layers in place on every device; "
                + (f"parallel {split} splits them" if split else f"zero_stage {stage} shards the state")
                + ": drop optimizer_layerwise (or use pure data parallelism)")
    offloaded = [k for k in ("offload_optimizer", "offload_master") if getattr(cfg, k)]
    if stage in (1, 2) and offloaded:  # one problem naming both, not the same sentence twice
        names = " and ".join(offloaded)
        add(("zero_stage", offloaded[0]), f"{stage} shards the optimizer state over the data devices; {names} "
            f"keep{'s' if len(offloaded) == 1 else ''} the state in host memory, whole, updated layer by layer: drop "
            f"one of the two (zero_stage 0 or 3 work with {names})")
    return out
