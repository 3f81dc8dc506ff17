"""The public Python API, for scripts and research notebooks. The CLI is a thin layer over these.

    import surojax as sj
    model = sj.load_model("path/to/hf_model")                 # a Decoder (Flax NNX); also a .gguf, a run folder,
    tokenizer = sj.load_tokenizer("path/to/hf_model")         # an adapter folder or a Hub id (org/name)
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
from surojax.data.tokenizer import Tokenizer
from surojax.model_loader import load_model_ref
from surojax.peft.stacked import load_adapter_into
from surojax.generation.loop import generate
from surojax.train.trainer import Trainer
from surojax.train.trainers import make_trainer
from surojax.weights.gguf_checkpoint import load_gguf_tokenizer
from surojax.weights.hf_checkpoint import save_model
from surojax.weights.model_ref import resolve_model

__all__ = ["Trainer", "TrainConfig", "build_trainer", "complete", "generate", "load_config", "load_model",
           "load_tokenizer", "save_model"]

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def load_model(ref: str | os.PathLike, *, dtype: str = "float32", adapter: str | os.PathLike | None = None):
    """A Decoder from any model reference (surojax.weights.model_ref: HF folder, .gguf file, training output
    folder, PEFT adapter folder, Hugging Face Hub id); an adapter the reference names is folded in.
    `adapter`: a PEFT adapter to load on top as the model's trainable LoRA adapter (to continue training it)."""
    model = load_model_ref(ref, dtype=_DTYPES[dtype]).model
    if adapter is not None:
        load_adapter_into(model, adapter, trainable=True)
    return model


def load_tokenizer(ref: str | os.PathLike) -> Tokenizer:
    """The tokenizer of any model reference (a GGUF's from its metadata), or of a folder holding tokenizer.json."""
    path = Path(ref).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_dir(path)
    r = resolve_model(ref, weights=False)
    return Tokenizer.from_dir(r.tokenizer_dir) if r.tokenizer_dir is not None else load_gguf_tokenizer(r.weights)


def build_trainer(config: dict[str, Any] | str | os.PathLike | TrainConfig, **overrides) -> Trainer:
    """A Trainer from a config dict, a YAML path or a TrainConfig; keyword overrides replace keys."""
    if isinstance(config, TrainConfig):
        cfg = config.model_copy(update=overrides) if overrides else config
    elif isinstance(config, dict):
        cfg = config_from_dict({**config, **overrides})
    else:
        cfg = load_config(Path(config), [f"{k}={v}" for k, v in overrides.items()])
    return make_trainer(cfg)


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
