"""The one model loader behind every command: a model reference (surojax.weights.model_ref) -> a Decoder with
its tokenizer.

    loaded = load_model_ref("runs/quickstart/lora", dtype=jnp.bfloat16)   # base + adapter folded in
    loaded.model, loaded.tokenizer, loaded.ref

An HF folder loads through surojax.weights.hf_checkpoint, a .gguf through surojax.weights.gguf_checkpoint; the
quantised Linear kernels of either (a GGUF file's, a pre-quantised HF checkpoint's: FP8, NVFP4, bitsandbytes NF4,
gpt-oss's published MXFP4 experts) are kept when `keep_quantized`, else dequantised to `param_dtype`. A reference
that names an adapter (an adapter folder, or a run folder holding adapter/) loads its base and folds the adapter
into the base kernels (`W + scale * A @ B`), so the result is a plain model. A LoRA delta cannot be folded into
quantised kernels: with an adapter a quantised base is always dequantised.

This module sits above weights/ and peft/ (it uses both) and below the CLI, the API, serving and training.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from surojax.data.tokenizer import Tokenizer
from surojax.hub import model_path
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.layers.attention_backend import AttentionBackend
from surojax.peft.stacked import load_adapter_into
from surojax.weights.gguf_checkpoint import load_gguf_model
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.model_ref import ModelRef, resolve_model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A loaded reference: the Decoder, its tokenizer and what was resolved (ref.tokenizer_dir is where the
    tokenizer files are, None when the tokenizer came from a GGUF's metadata)."""

    model: Decoder
    tokenizer: Tokenizer
    ref: ModelRef


def load_base(ref: ModelRef, *, dtype=jnp.float32, param_dtype=None, attention: AttentionBackend | str = "auto",
              keep_quantized: bool = False, cfg: ModelConfig | None = None,
              shardings_of: Callable[[nnx.State], nnx.State] | None = None) -> tuple[Decoder, Tokenizer | None]:
    """The base weights of `ref` (its adapter is not applied) -> (Decoder, the GGUF metadata's tokenizer or None).

    dtype: compute dtype; param_dtype: storage dtype (default dtype); cfg: an architecture to use instead of the
    reference's own (e.g. with max_position_embeddings changed); keep_quantized: see the module docstring;
    shardings_of: an HF folder's float parameters made straight into these shardings (surojax.weights.
    hf_checkpoint.load_model; a GGUF file and quantised kernels are read whole)."""
    if ref.kind == "gguf":
        _, model, tokenizer = load_gguf_model(ref.weights, dtype=dtype, param_dtype=param_dtype, attention=attention,
                                              cfg=cfg, keep_quantized=keep_quantized)
        return model, tokenizer
    return load_model(ref.weights, dtype=dtype, param_dtype=param_dtype, attention=attention, cfg=cfg,
                      keep_quantized=keep_quantized, shardings_of=shardings_of), None


def load_model_ref(ref: str | os.PathLike | ModelRef, *, dtype=jnp.float32, param_dtype=None,
                   attention: AttentionBackend | str = "auto",
                   keep_quantized: bool = False, cfg: ModelConfig | None = None,
                   tokenizer_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load any model reference (surojax.weights.model_ref) with its adapter folded in and its tokenizer.

    tokenizer_dir: a folder with tokenizer.json (or a Hub id) to use instead of the reference's. A GGUF's tokenizer
    comes from its metadata (or from the adapter folder's tokenizer.json when an adapter names the GGUF as its base).
    """
    r = ref if isinstance(ref, ModelRef) else resolve_model(ref, weights=False)
    tok_dir = model_path(tokenizer_dir, weights=False) if tokenizer_dir is not None else r.tokenizer_dir
    tokenizer = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None  # before the weights: fails fast
    if not isinstance(ref, ModelRef):
        r = resolve_model(ref)  # a Hub id's weight files are fetched now
    if r.adapter is not None and keep_quantized:
        log.info("%s: dequantising the base to fold the adapter %s into it", r.weights, r.adapter)
    model, gguf_tokenizer = load_base(r, dtype=dtype, param_dtype=param_dtype, attention=attention,
                                      keep_quantized=keep_quantized and r.adapter is None, cfg=cfg)
    if r.adapter is not None:
        log.info("folding the adapter %s into its base %s", r.adapter, r.weights)
        load_adapter_into(model, r.adapter, trainable=False)
    return LoadedModel(model, tokenizer if tokenizer is not None else gguf_tokenizer, r)
