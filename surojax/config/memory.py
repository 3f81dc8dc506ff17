"""Memory keys: recomputation, attention backend, chunking, and what lives in host memory."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from surojax.config.base import StrictModel


class MemorySection(StrictModel):
    recompute: Literal["auto", "none", "full", "dots", "offload"] = "auto"
    """Activation remat per decoder layer: auto (default: the fastest setting whose planned peak fits the device,
    chosen with unroll_layers; surojax/offload/layer_loop_choice.py), none, full (recompute the layer), dots (save
    matmul outputs only), offload (save activations to host memory). true / false mean full / none."""
    unroll_layers: Literal["auto"] | int | bool = "auto"
    """Layers per iteration of the scanned layer loop: auto (default: chosen with recompute, see above); 1 compiles
    one layer; true inlines every layer, which keeps the activations saved for the backward as separate buffers
    instead of [L, ...] stacks (faster step, less memory with recompute none, longer compile)."""
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    """Attention backend; auto picks cuDNN flash attention on GPU where it applies, else XLA."""
    lmhead_chunks: int = Field(default=1, gt=0)
    """Compute LM head + cross-entropy in this many sequence chunks (logits never fully materialised)."""
    sequence_chunks: int = Field(default=1, gt=0)
    long_context: bool = False
    """Tile the MLP over the sequence for very long rows."""
    offload_base_weights: bool = False
    """Keep frozen base weights in host memory and stream them to the GPU one layer at a time."""
    offload_prefetch: bool = False
    """With offload_base_weights: fetch layer l+1 while layer l computes (a double-buffered layer loop, forward
    and backward recompute; needs recompute: full). Same results bit for bit; see docs/memory.md."""
    offload_optimizer: bool = False
    """Keep the decoder layers' optimizer state in host memory (updated layer by layer)."""
    offload_master: bool = False
    """Full fine-tuning, bf16 recipe: keep the decoder layers' fp32 master weights in host memory (the device keeps
    their bf16 copy; updated layer by layer, with or without offload_optimizer)."""
    optimizer_layerwise: bool = False
    """Full fine-tuning on one device or pure data parallelism: update the decoder layers' weights and optimizer
    state in place, one layer at a time, on the device. The whole-tree update holds several gradient-sized
    temporaries at once (~40 bytes per parameter with adamw_8bit: Qwen3-8B full fine-tuning needs it to fit one
    H200). Same update; the optimizer state is stored per layer, so a checkpoint resumes only with the same
    setting. Not with LoRA, auto_lr_reduction, zero_stage 1-3 or fsdp / tensor / expert / stage splits."""
    offload_grads: bool = False

    @field_validator("unroll_layers")
    @classmethod
    def _positive_unroll(cls, v: str | int | bool) -> str | int | bool:
        if v == "auto":
            return v
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"must be true, false or a positive number of layers (got {v})")
        return 1 if v is False else v

    @field_validator("recompute", mode="before")
    @classmethod
    def _bool_recompute(cls, v: Any) -> Any:
        if v is True:
            return "full"
        if v is False:
            return "none"
        return v
