"""Distillation keys (`trainer: distill`): the teacher, where its top-K log-probs come from, and the loss mix.

    loss = alpha x T^2 x KL(teacher || student) on the teacher's top-K ids + (1 - alpha) x CE on the labels

(surojax/losses/distill.py states the KL exactly). Every key here is refused when `trainer` is not distill
(config/rules.py).
"""
from __future__ import annotations

from pydantic import Field

from surojax.config.base import StrictModel


class DistillSection(StrictModel):
    teacher: str | None = None
    """The teacher model: an HF folder, a .gguf file (its quantised kernels are kept), a surojax output folder or a
    Hugging Face Hub id; any supported family. It must use the student's tokenizer. Loaded and run
    frozen in the same process unless `teacher_logprobs` is set."""
    teacher_logprobs: str | None = None
    """A sidecar folder of the teacher's precomputed top-K log-probs (`surojax distill CONFIG --precompute` writes
    it, here or to <output_dir>/teacher_logprobs). A run with it never loads the teacher; when `teacher` is also
    set, the sidecar must have been written by that teacher."""
    teacher_top_k: int = Field(default=64, gt=0)
    """How many of the teacher's most likely tokens per position the KL covers (their probabilities renormalised
    over the K). 64 keeps nearly all of an LLM's probability mass at 512 bytes a position (ids + fp32 log-probs)."""
    alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    """Weight of the KL term; the CE on the labels gets 1 - alpha. 1: pure distillation; 0: plain SFT."""
    # `temperature` (one key, defined in config/grpo.py) softens both distributions (teacher top-K and student
    # softmax) by T for distillation; the KL is then scaled by T^2 (Hinton).
