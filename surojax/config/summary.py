"""A few lines that say what a TrainConfig will do, for the console before training starts."""
from __future__ import annotations

from surojax.config.schema import TrainConfig


def _method(cfg: TrainConfig) -> str:
    if not cfg.lora:
        return "full fine-tuning" if not cfg.from_scratch else "pretraining from scratch"
    quant = cfg.qlora
    kind = f"QLoRA ({quant} base)" if quant else "LoRA"
    scale = "rs" if cfg.use_rslora else ""
    s = f"{kind} r={cfg.lora_rank} alpha={cfg.lora_alpha:g} {scale}on {','.join(cfg.lora_target_modules)}"
    if cfg.adapter_path:
        s += f" over {cfg.adapter_path} ({cfg.adapter_init_mode or 'merge'})"
    return s


def summarize(cfg: TrainConfig) -> list[str]:
    """Short `label: value` lines."""
    length = f"{cfg.max_steps} steps" if cfg.max_steps else f"{cfg.num_epochs:g} epoch(s)"
    warm = (f"warmup {cfg.warmup_steps} steps" if cfg.warmup_steps is not None
            else f"warmup {cfg.warmup_ratio:g}" if cfg.warmup_ratio is not None else "no warmup")
    data = ", ".join(f"{d.path} ({d.type})" for d in cfg.datasets)
    mesh = " ".join(f"{a}={'rest' if n == -1 else n}" for a, n in cfg.parallel.sizes().items() if n != 1)
    offload = [name for name, on in (("base_weights", cfg.offload_base_weights), ("optimizer", cfg.offload_optimizer),
                                     ("master", cfg.offload_master)) if on]
    return [
        f"model:     {cfg.model or '(from model_config)'}",
        f"method:    {_method(cfg)}",
        f"precision: {cfg.recipe}"
        + (f" ({cfg.resolved_fp8_scaling} scaling)" if cfg.recipe == "fp8_hybrid" else "")
        + f", recompute={cfg.recompute}, attention={cfg.attention}"
        + (f", offload {'+'.join(offload)}" if offload else ""),
        f"data:      {data}; sequence_len={cfg.sequence_len}, packing={'on' if cfg.sample_packing else 'off'}",
        f"batch:     {cfg.per_device_train_batch_size} rows x {cfg.gradient_accumulation_steps} accumulation "
        f"per replica; mesh {mesh or 'single device'}",
        f"optimizer: {cfg.optimizer} lr={cfg.learning_rate:g} {cfg.lr_scheduler_type}, {warm}; {length}",
        f"output:    {cfg.output_dir}",
    ]
