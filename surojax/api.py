"""The public Python API, for scripts and research notebooks. The CLI is a thin layer over these.

    import surojax as sj
    model = sj.load_model("path/to/hf_model")                 # a Decoder (Flax NNX)
    tokenizer = sj.load_tokenizer("path/to/hf_model")
    print(sj.complete(model, tokenizer, "Tom has 3 apples", max_new_tokens=16))

    trainer = sj.Trainer.from_config({"model": ..., "datasets": [...], "lora": True, "max_steps": 100})
    trainer.step()                    # one optimizer step -> {"loss": ..., "grad_norm": ..., "lr": ...}
    trainer.train()                   # the whole run (evals, checkpoints, export, loss chart)
    trainer.metrics.history           # every logged step as a dict
    trainer.export("out/adapter")     # PEFT adapter (LoRA) or HF folder (full)
    model = trainer.trained_model()   # the trained Decoder
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from surojax.config import TrainConfig, config_from_dict, load_config
from surojax.data.hub import resolve_local
from surojax.data.tokenizer import Tokenizer
from surojax.generation.loop import generate
from surojax.train.trainer import Trainer
from surojax.weights.hf_checkpoint import load_model as _load_model
from surojax.weights.hf_checkpoint import save_model

__all__ = ["Trainer", "TrainConfig", "build_trainer", "complete", "generate", "load_config", "load_model",
           "load_tokenizer", "save_model"]

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def load_model(path: str | os.PathLike, *, dtype: str = "float32", adapter: str | os.PathLike | None = None):
    """A Decoder from an HF folder (or a repo id in the local HF cache); `adapter` folds a PEFT adapter in."""
    model = _load_model(path, dtype=_DTYPES[dtype])
    if adapter is not None:
        from surojax.peft.stacked import load_adapter_into

        load_adapter_into(model, adapter, trainable=True)
    return model


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    return Tokenizer.from_dir(resolve_local(str(path)))


def build_trainer(config: dict[str, Any] | str | os.PathLike | TrainConfig, **overrides) -> Trainer:
    """A Trainer from a config dict, a YAML path or a TrainConfig; keyword overrides replace keys."""
    if isinstance(config, TrainConfig):
        cfg = config.model_copy(update=overrides) if overrides else config
    elif isinstance(config, dict):
        cfg = config_from_dict({**config, **overrides})
    else:
        cfg = load_config(Path(config), [f"{k}={v}" for k, v in overrides.items()])
    return Trainer(cfg)


Trainer.from_config = staticmethod(build_trainer)


def complete(model, tokenizer: Tokenizer, prompt: str | list[dict], *, max_new_tokens: int = 64,
             temperature: float = 0.0, seed: int = 0) -> str:
    """Generate a completion for a text prompt, or for chat messages (rendered with the chat template)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    stops = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    out = generate(model, [ids], max_new_tokens, temperature=temperature, seed=seed, stop_ids=stops)[0]
    return tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=True)
