"""LoRA as a transform on a built model (lora), PEFT-format adapter files (peft_io), stacked adapters (stacked)."""
from surojax.peft.lora import (FROZEN, LORA_TARGETS, TRAINABLE, LoRADropoutKey, LoRALinear, apply_lora, lora_modules,
                               merge_lora, set_dropout_key)
from surojax.peft.peft_io import AdapterError, LoraSpec, PeftAdapter, load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import init_lora, load_adapter_into

__all__ = ["FROZEN", "LORA_TARGETS", "TRAINABLE", "AdapterError", "LoRADropoutKey", "LoRALinear", "LoraSpec",
           "PeftAdapter", "apply_lora", "init_lora", "load_adapter_into", "load_peft_adapter", "lora_modules",
           "merge_lora", "save_peft_adapter", "set_dropout_key"]
