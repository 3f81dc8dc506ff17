"""What a model reference names, resolved once for every command (train, generate, serve, merge, export, quantize).

A reference (`--model`, `model:`, `serve MODEL`) is one of:

    path/to/hf_folder          config.json + model.safetensors (or an index + shards)
    path/to/model.gguf         a llama.cpp GGUF file (architecture and tokenizer from its metadata)
    path/to/output_dir         a surojax training run: its merged/ or model/ (full fine-tuning) or adapter/ (LoRA;
                               the run also copies the adapter's two files to the top of output_dir, as Surogate
                               writes it: those subfolders are looked at first)
    path/to/adapter            a PEFT adapter folder; adapter_config.json's base_model_name_or_path names the base
    org/name[@revision]        a repo id present in the local Hugging Face cache (surojax.hub; never downloads)

`resolve_model` only looks at files (no weights are read); `surojax.model_loader.load_model_ref` loads what it
finds. Every refusal is a ModelRefError naming the path and what was expected there.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from surojax.hub import resolve_local
from surojax.weights.gguf_checkpoint import is_gguf_path, read_gguf_hf_config
from surojax.weights.json_file import read_json_object
from surojax.weights.safetensors_file import WeightsError

ADAPTER_CONFIG = "adapter_config.json"
RUN_SUBFOLDERS = ("merged", "model", "adapter")  # a training output_dir, in the order they are preferred
EXPECTED = ("an HF model folder (config.json + safetensors), a .gguf file, a surojax output folder (merged/, model/ "
            "or adapter/), a PEFT adapter folder (adapter_config.json) or a repo id in the local HF cache")


class ModelRefError(WeightsError):
    """A model reference that names nothing loadable: the message names the path and what was expected."""


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A resolved model reference.

    kind: "hf" (weights is a folder with config.json + safetensors) or "gguf" (weights is the .gguf file).
    adapter: a PEFT adapter folder to fold into the base weights, or None.
    tokenizer_dir: the folder holding tokenizer.json (the adapter's own copy first, else the base folder) and
        generation_config.json; None for a GGUF, whose tokenizer comes from the file's metadata.
    source: the reference as the user gave it.
    """

    kind: Literal["hf", "gguf"]
    weights: Path
    adapter: Path | None
    tokenizer_dir: Path | None
    source: str

    @property
    def name(self) -> str:
        """A short display name: the file's stem, the folder's name (the run folder's for model/, adapter/)."""
        p = Path(self.source.rstrip("/")).expanduser()
        return p.stem if p.suffix.lower() == ".gguf" else p.name


def resolve_model(ref: str | os.PathLike) -> ModelRef:
    """The ModelRef of `ref` (see the module docstring). Raises ModelRefError (or ModelNotFoundError from the
    HF-cache lookup) naming the path and what was expected."""
    source = os.fspath(ref)
    base, adapter = _resolve_base_or_adapter(source, source)
    if adapter is None:
        return base
    tokenizer_dir = adapter if (adapter / "tokenizer.json").is_file() else base.tokenizer_dir
    return dataclasses.replace(base, adapter=adapter, tokenizer_dir=tokenizer_dir, source=source)


def _resolve_base_or_adapter(ref: str, source: str) -> tuple[ModelRef, Path | None]:
    """(base ModelRef, adapter folder or None)."""
    path = Path(ref).expanduser()
    if path.is_file():
        return _file_ref(path, source), None
    if path.is_dir():
        return _dir_ref(path, source)
    if is_gguf_path(ref):
        raise ModelRefError(f"model {source}: {path} does not exist (expected a .gguf file)")
    return _dir_ref(resolve_local(ref), source)  # a repo id in the local HF cache, or ModelNotFoundError


def _file_ref(path: Path, source: str) -> ModelRef:
    if not is_gguf_path(path):
        raise ModelRefError(f"model {source}: {path} is a file but not a .gguf file; expected {EXPECTED}")
    return ModelRef("gguf", path, None, None, source)


def _dir_ref(path: Path, source: str) -> tuple[ModelRef, Path | None]:
    if (path / "config.json").is_file():
        return ModelRef("hf", path, None, path, source), None
    for sub in RUN_SUBFOLDERS:  # a run's folders first: its output_dir also holds the adapter's files at its top
        if (path / sub / "config.json").is_file():
            return ModelRef("hf", path / sub, None, path / sub, source), None
        if sub == "adapter" and (path / sub / ADAPTER_CONFIG).is_file():
            return _adapter_base(path / sub, source), path / sub
    if (path / ADAPTER_CONFIG).is_file():
        return _adapter_base(path, source), path
    raise ModelRefError(f"model {source}: {path} is not a model folder: it holds no config.json, {ADAPTER_CONFIG}, "
                        f"merged/, model/ or adapter/; expected {EXPECTED}")


def adapter_base_name(adapter_dir: Path) -> str:
    """adapter_config.json's base_model_name_or_path (a ModelRefError naming the file when absent)."""
    cfg_file = adapter_dir / ADAPTER_CONFIG
    cfg = read_json_object(cfg_file, ModelRefError)
    base = cfg.get("base_model_name_or_path")
    if not base or not isinstance(base, str):
        raise ModelRefError(f"{cfg_file}: no base_model_name_or_path, so the base model is unknown; pass the base "
                            f"model and the adapter separately (e.g. surojax merge --base-model DIR --adapter "
                            f"{adapter_dir})")
    return base


def _adapter_base(adapter_dir: Path, source: str) -> ModelRef:
    """The base an adapter names. A relative path is read from the current directory (adapters written before
    the path was stored absolute hold the training directory's relative path)."""
    base = adapter_base_name(adapter_dir)
    cfg_file = adapter_dir / ADAPTER_CONFIG
    try:
        ref, nested = _resolve_base_or_adapter(base, base)
    except (ModelRefError, FileNotFoundError) as e:
        relative = "" if Path(base).expanduser().is_absolute() else f" (relative to {Path.cwd()})"
        raise ModelRefError(f"model {source}: the base model {base!r}{relative} named by base_model_name_or_path in "
                            f"{cfg_file} cannot be loaded: {e}") from None
    if nested is not None:
        raise ModelRefError(f"model {source}: the base model {base!r} named in {cfg_file} is itself an adapter "
                            f"({nested}); merge it into its base first (surojax merge)")
    return ref


def hf_config_of(ref: str | os.PathLike | ModelRef) -> dict:
    """The config.json dict of any reference: an HF folder's config.json, a GGUF's metadata read as one, the
    base's for an adapter."""
    r = ref if isinstance(ref, ModelRef) else resolve_model(ref)
    if r.kind == "gguf":
        return read_gguf_hf_config(r.weights)
    return read_json_object(r.weights / "config.json", ModelRefError)
