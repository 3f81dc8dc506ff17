"""What a model reference names, resolved once for every command (train, generate, serve, merge, export, quantize).

A reference (`--model`, `model:`, `serve MODEL`) is one of:

    path/to/hf_folder          config.json + model.safetensors (or an index + shards)
    path/to/model.gguf         a llama.cpp GGUF file (architecture and tokenizer from its metadata); a model split
                               in files name-00001-of-0000N.gguf .. by any part's name (weights/gguf_split.py)
    path/to/output_dir         a surojax training run: its merged/ or model/ (full fine-tuning) or adapter/ (LoRA;
                               the run also copies the adapter's two files to the top of output_dir, as Surogate
                               writes it: those subfolders are looked at first)
    path/to/adapter            a PEFT adapter folder; adapter_config.json's base_model_name_or_path names the base
    org/name[@revision]        a Hugging Face Hub repo of any kind above, fetched into the HF cache (surojax.hub)
    org/name[@revision]:QUANT  the .gguf file of that quantisation in a Hub GGUF repo

`resolve_model` only looks at files (no weights are read); `surojax.model_loader.load_model_ref` loads what it
finds. A Hub id is fetched in surojax.hub's two steps with the architecture checked between them: the head files,
then config.json parsed as a ModelConfig (an unsupported family fails here, before any weight is downloaded),
then the weight files (not with `weights=False`, for callers that need only the config or the tokenizer).
Every refusal is a ModelRefError naming the path and what was expected there.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from surojax.hub import model_path, parse_hub_id, repo_files
from surojax.models.config import ModelConfig, ModelConfigError
from surojax.weights.gguf_checkpoint import is_gguf_path, read_gguf_hf_config
from surojax.weights.gguf_split import model_name
from surojax.weights.json_file import read_json_object
from surojax.weights.safetensors_file import WeightsError

ADAPTER_CONFIG = "adapter_config.json"
RUN_SUBFOLDERS = ("merged", "model", "adapter")  # a training output_dir, in the order they are preferred
EXPECTED = ("an HF model folder (config.json + safetensors), a .gguf file, a surojax output folder (merged/, model/ "
            "or adapter/), a PEFT adapter folder (adapter_config.json) or a Hugging Face Hub id (org/name[@revision], "
            "org/name:QUANT for a GGUF repo)")


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
    def model_dir(self) -> Path | None:
        """The base model's HF folder (config.json, preprocessor_config.json: what decides whether it takes
        images), also when an adapter is folded in; None for a GGUF."""
        return self.weights if self.kind == "hf" else None

    @property
    def name(self) -> str:
        """A short display name: a Hub id's org/name (as vLLM serves it), the file's stem, the folder's name (the
        run folder's for model/, adapter/)."""
        p = Path(self.source.rstrip("/")).expanduser()
        hub_id = parse_hub_id(self.source)
        if hub_id is not None and not p.exists():
            return hub_id.repo
        return model_name(p) if p.suffix.lower() == ".gguf" else p.name


def names_gguf(ref: str | os.PathLike | None) -> bool:
    """Whether a reference names a GGUF: a .gguf path, or a Hub GGUF id org/name:QUANT."""
    if ref is None:
        return False
    hub_id = parse_hub_id(ref)
    return is_gguf_path(ref) or (hub_id is not None and hub_id.quant is not None
                                 and not Path(os.fspath(ref)).expanduser().exists())


def resolve_model(ref: str | os.PathLike, *, weights: bool = True) -> ModelRef:
    """The ModelRef of `ref` (see the module docstring). Raises ModelRefError (or ModelNotFoundError from the
    Hub) naming the reference and what was expected. weights=False: a Hub id's weight files are not fetched."""
    source = os.fspath(ref)
    base, adapter = _resolve_base_or_adapter(source, source, weights)
    if adapter is None:
        return base
    tokenizer_dir = adapter if (adapter / "tokenizer.json").is_file() else base.tokenizer_dir
    return dataclasses.replace(base, adapter=adapter, tokenizer_dir=tokenizer_dir, source=source)


def _resolve_base_or_adapter(ref: str, source: str, weights: bool) -> tuple[ModelRef, Path | None]:
    """(base ModelRef, adapter folder or None)."""
    path = Path(ref).expanduser()
    if path.is_file():
        return _file_ref(path, source), None
    if path.is_dir():
        return _dir_ref(path, source, weights)
    if is_gguf_path(ref):
        raise ModelRefError(f"model {source}: {path} does not exist (expected a .gguf file)")
    return _hub_ref(ref, source, weights)  # a Hub id, or ModelNotFoundError naming why not


def _hub_ref(ref: str, source: str, weights: bool) -> tuple[ModelRef, Path | None]:
    """A Hub id: the head files, config.json checked as an architecture, then the weights (module docstring)."""
    head = model_path(ref, weights=False)
    if head.is_file():  # org/name:QUANT
        return _file_ref(head, source), None
    config = head / "config.json"
    if config.is_file():
        try:
            ModelConfig.from_hf(read_json_object(config, ModelRefError))
        except (ModelConfigError, ValueError, TypeError, KeyError) as e:
            raise ModelRefError(f"model {source}: {e} (the Hub repo's {config})") from None
    elif not (head / ADAPTER_CONFIG).is_file():
        ggufs = [f for f in repo_files(ref) if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
        hint = (f"; it holds GGUF files ({', '.join(ggufs[:4])}{' ...' if len(ggufs) > 4 else ''}): name one as "
                f"{ref}:QUANT, e.g. {ref}:Q4_K_M") if ggufs else f"; expected {EXPECTED}"
        raise ModelRefError(f"model {source}: the Hub repo {ref!r} has no config.json or {ADAPTER_CONFIG}{hint}")
    return _dir_ref(model_path(ref) if weights else head, source, weights)


def _file_ref(path: Path, source: str) -> ModelRef:
    if not is_gguf_path(path):
        raise ModelRefError(f"model {source}: {path} is a file but not a .gguf file; expected {EXPECTED}")
    return ModelRef("gguf", path, None, None, source)


def _dir_ref(path: Path, source: str, weights: bool) -> tuple[ModelRef, Path | None]:
    if (path / "config.json").is_file():
        return ModelRef("hf", path, None, path, source), None
    for sub in RUN_SUBFOLDERS:  # a run's folders first: its output_dir also holds the adapter's files at its top
        if (path / sub / "config.json").is_file():
            return ModelRef("hf", path / sub, None, path / sub, source), None
        if sub == "adapter" and (path / sub / ADAPTER_CONFIG).is_file():
            return _adapter_base(path / sub, source, weights), path / sub
    if (path / ADAPTER_CONFIG).is_file():
        return _adapter_base(path, source, weights), path
    ggufs = sorted(p.name for p in path.iterdir() if is_gguf_path(p))
    if ggufs:  # a folder of GGUF files (several quantisations, or a split model's parts): the file is named
        more = f" ... and {len(ggufs) - 4} more" if len(ggufs) > 4 else ""
        raise ModelRefError(f"model {source}: {path} holds GGUF files ({', '.join(ggufs[:4])}{more}) and no "
                            "config.json: name the .gguf file (for a split model, any of its parts)")
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


def _adapter_base(adapter_dir: Path, source: str, weights: bool) -> ModelRef:
    """The base an adapter names (a path or a Hub id). A relative path is read from the current directory
    (adapters written before the path was stored absolute hold the training directory's relative path)."""
    base = adapter_base_name(adapter_dir)
    cfg_file = adapter_dir / ADAPTER_CONFIG
    try:
        ref, nested = _resolve_base_or_adapter(base, base, weights)
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
    r = ref if isinstance(ref, ModelRef) else resolve_model(ref, weights=False)
    if r.kind == "gguf":
        return read_gguf_hf_config(r.weights)
    return read_json_object(r.weights / "config.json", ModelRefError)
