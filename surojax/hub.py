"""Names -> local files: a path on disk as is; a Hugging Face Hub id through the real clients and their caches.

Every place a model or dataset is named (`model:`, `tokenizer:`, `teacher:`, `adapter_path:`, `datasets[].path`,
`generate --model`, `serve MODEL`, draft models, `--lora-modules NAME=REF`, `merge --base-model`, an adapter's
base_model_name_or_path) resolves here. A name that exists on disk is a path. Otherwise a Hub id:

    org/name                 the repo's default branch (main)
    org/name@revision        a branch, tag or commit hash
    org/name:QUANT           models: the GGUF file of that quantisation in a GGUF repo (llama.cpp's `-hf repo:quant`,
    org/name@revision:QUANT  case-insensitive; a split file's parts -0000i-of-0000N come together), e.g.
                             Qwen/Qwen3-0.6B-GGUF:Q8_0
Names that look like paths (./x, /x, ~/x, a/b/c, or ending in a file suffix such as .jsonl / .gguf) never are ids.

Models (`model_path`) go through huggingface_hub's snapshot_download into the hub cache transformers shares
($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), in two steps:
    head      the small files (HEAD_FILES: config, generation config, safetensors index, adapter config, tokenizer
              files, chat templates, a vision model's image processor); a bad id, a missing revision, a gated
              repo (401/403) or no network fails here on a few KB, and surojax.weights.model_ref validates
              config.json before the next step;
    weights   exactly the files the head names: the index's shards or model.safetensors, adapter_model.safetensors;
              never *.bin / *.pt / onnx / original/ copies.
The client shows the progress bar, resumes partial downloads and sends HF_TOKEN. The revision resolves once per
process (the head's commit), so both steps read one snapshot. HF_HUB_OFFLINE=1 (or an unreachable Hub) reads
the cache only, the revision honoured through refs/; a miss is a HubError naming the id and why. HF_ENDPOINT,
HF_HUB_OFFLINE and the cache variables are read when a name is resolved (and passed to the client), not when
the client was imported.

Datasets (`check_dataset`, `load_dataset`) go through the `datasets` library and its cache (imported only when a
Hub dataset is named): `subset` is its configuration name, `split` a split ("train[:100]" slices pass through),
`data_files` its data_files; offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) it reads what was loaded before.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Literal

import httpx
from huggingface_hub import constants as hf_constants
from huggingface_hub import get_cached_repo_tree, snapshot_download
from huggingface_hub.errors import (CachedRepoTreeNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError,
                                    IncompleteSnapshotError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                    RepositoryNotFoundError, RevisionNotFoundError)

log = logging.getLogger(__name__)

Kind = Literal["model", "dataset"]

HEAD_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "adapter_config.json",
              "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
              "additional_chat_templates/*.jinja", "preprocessor_config.json")
PATH_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet", ".csv", ".arrow", ".txt", ".yaml", ".yml", ".gguf",
                 ".safetensors", ".bin", ".pt")
_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_ID = re.compile(rf"^(?P<repo>{_REPO})(?:@(?P<revision>[^@:\s]+))?(?::(?P<quant>[A-Za-z0-9][\w.-]*))?$")
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(FileNotFoundError):
    """A name that is neither a local path nor something the Hub (or the cache) gives: the message names the id
    and the reason."""

    is_user_error = True


class ModelNotFoundError(HubError):
    """A model / tokenizer / adapter name that cannot be resolved."""


class DatasetNotFoundError(HubError):
    """A dataset name (or its subset / split) that cannot be resolved."""


@dataclasses.dataclass(frozen=True)
class HubId:
    """A parsed Hub id: `repo` is org/name; `quant` selects a GGUF file (models only)."""

    repo: str
    revision: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")


def parse_hub_id(name: str | os.PathLike, kind: Kind = "model") -> HubId | None:
    """The HubId `name` spells, or None when it reads as a path (see the module docstring). Existence on disk is
    not checked here: a name that exists is a path to every caller."""
    text = os.fspath(name)
    m = _ID.match(text)
    if m is None or text.startswith(("/", ".", "~")) or m["repo"].lower().endswith(PATH_SUFFIXES):
        return None
    if m["quant"] is not None and kind != "model":
        return None
    return HubId(m["repo"], m["revision"], m["quant"])


_URL = re.compile(r"^[A-Za-z][\w+.-]*://")


def missing_name(name: str | os.PathLike, kind: Kind = "model") -> str:
    """Why a name that is no local path and no Hub id names nothing (a remote URL is said to be one)."""
    text = os.fspath(name)
    if _URL.match(text):
        return (f"{text} is a URL: surojax reads local paths and Hugging Face Hub ids (org/name), not remote URLs; "
                "copy the files to a local folder")
    what = "Hub id" if kind == "model" else "Hub dataset id"
    return (f"{Path(text).expanduser()} does not exist (and is not a Hugging Face {what} like org/name or "
            "org/name@revision)")


# ---------------------------------------------------------------------------------------------- environment

def _env_true(*names: str) -> bool:
    return any(os.environ.get(n, "").upper() in _TRUE for n in names)


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory the environment points at (huggingface_hub's own order)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now, or when huggingface_hub was imported."""
    return _env_true("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") or hf_constants.HF_HUB_OFFLINE


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or hf_constants.ENDPOINT).rstrip("/")


def _why(e: BaseException, hid: HubId, offline: bool, cache: Path) -> str:
    """The reason of a huggingface_hub error about a model repo, in words: what is wrong and what to do."""
    rev = hid.revision or "main"
    if isinstance(e, GatedRepoError):
        return (f"the repo is gated (HTTP {e.response.status_code}): accept its terms at {_endpoint()}/{hid.repo} "
                "and set HF_TOKEN to a token of that account")
    if isinstance(e, RevisionNotFoundError):
        return f"the repo has no revision {rev!r} (a branch, tag or commit hash)"
    if isinstance(e, RepositoryNotFoundError):
        status = e.response.status_code if e.response is not None else "?"
        return (f"no such local path, and no such model repo on the Hub at {_endpoint()} (HTTP {status}; a private "
                "repo needs HF_TOKEN)")
    if isinstance(e, IncompleteSnapshotError):
        why = "offline (HF_HUB_OFFLINE is set)" if offline else "the Hub cannot be reached"
        return f"{why} and the cached snapshot of revision {rev!r} in {cache} lacks files: {e}"
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx.TransportError)):
        if offline:
            return (f"offline (HF_HUB_OFFLINE is set) and revision {rev!r} is not in the cache {cache}; run once "
                    "with network access (or unset HF_HUB_OFFLINE)")
        cause = e.__cause__ or e.__context__ or e
        return (f"the Hub at {_endpoint()} cannot be reached ({type(cause).__name__}: {str(cause).splitlines()[0]}) "
                f"and revision {rev!r} is not in the cache {cache}")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return f"the Hub answered HTTP {status}: {str(e).strip().splitlines()[-1]}"
    return f"{type(e).__name__}: {e}"


_CLIENT_ERRORS = (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, HFValidationError,
                  httpx.TransportError)


# ---------------------------------------------------------------------------------------------------- models

def model_path(name: str | os.PathLike, *, weights: bool = True) -> Path:
    """A local path for a model / tokenizer / adapter name: the path itself if it exists; for a Hub id the
    snapshot folder (weights=False: the head files only) or, for org/name:QUANT, the (first) .gguf file.
    Raises ModelNotFoundError naming the name and why."""
    text = os.fspath(name)
    path = Path(text).expanduser()
    if path.exists():
        return path
    hid = parse_hub_id(text)
    if hid is None:
        raise ModelNotFoundError(f"model {text!r}: {missing_name(text)}")
    if hid.quant is not None:
        return _fetch_gguf(hid)
    head = _fetch_head(hid)
    return _fetch_weights(hid, head) if weights else head


_FETCHED: dict[tuple, Path] = {}  # (step, hub id, ..., endpoint, cache, offline) -> path: each resolves once


def _snapshot(hid: HubId, revision: str | None, patterns: list[str], *, partial_ok: bool = False) -> Path:
    """snapshot_download of the files matching `patterns`; client errors become a ModelNotFoundError.
    partial_ok: offline, a cached snapshot missing some of them is returned as it is (the head files are a
    superset of what one run reads: the caller checks the files it needs)."""
    cache, offline = hf_hub_cache(), hub_offline()
    try:
        return Path(snapshot_download(hid.repo, repo_type="model", revision=revision, allow_patterns=patterns,
                                      cache_dir=cache, endpoint=_endpoint(), local_files_only=offline))
    except IncompleteSnapshotError as e:
        if partial_ok and Path(e.snapshot_path).is_dir():
            return Path(e.snapshot_path)
        raise ModelNotFoundError(f"model {str(hid)!r}: {_why(e, hid, offline, cache)}") from None
    except _CLIENT_ERRORS as e:
        raise ModelNotFoundError(f"model {str(hid)!r}: {_why(e, hid, offline, cache)}") from None


def _memo(key: tuple, make: Callable[[], Path]) -> Path:
    key = (*key, _endpoint(), hf_hub_cache(), hub_offline())
    if key not in _FETCHED or not _FETCHED[key].exists():
        _FETCHED[key] = make()
    return _FETCHED[key]


def _fetch_head(hid: HubId) -> Path:
    """The snapshot folder with the head files (its name is the commit the revision resolved to)."""
    return _memo(("head", hid), lambda: _snapshot(hid, hid.revision, list(HEAD_FILES), partial_ok=True))


def _repo_files(hid: HubId, snapshot: Path) -> list[str]:
    """The files of the snapshot's commit: the tree listing snapshot_download cached, else what is on disk."""
    try:
        tree = get_cached_repo_tree(hid.repo, revision=snapshot.name, cache_dir=hf_hub_cache())
        return sorted(f.path for f in tree)
    except CachedRepoTreeNotFoundError:
        return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def repo_files(name: str) -> list[str]:
    """Every file of the Hub model repo `name` at its revision (the tree listing, as fetched with its head)."""
    hid = parse_hub_id(name)
    if hid is None:
        raise ModelNotFoundError(f"model {name!r}: not a Hugging Face Hub id like org/name")
    return _repo_files(hid, _fetch_head(hid))


def weight_files(folder: Path) -> list[str]:
    """The weight files a model / adapter folder names: the index's shards, model.safetensors or
    adapter_model.safetensors ([] when it names none, e.g. a tokenizer-only repo)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return []  # the loader names what is wrong with the index
    if (folder / "config.json").is_file():
        return ["model.safetensors"]
    if (folder / "adapter_config.json").is_file():
        return ["adapter_model.safetensors"]
    return []


def _fetch_weights(hid: HubId, head: Path) -> Path:
    names = weight_files(head)
    if not names:
        return head
    commit = head.name

    def fetch() -> Path:
        log.info("%s: fetching %s (revision %s) into %s", hid, ", ".join(names), commit[:12], hf_hub_cache())
        folder = _snapshot(hid, commit, [glob.escape(n) for n in names])
        missing = [n for n in names if not (folder / n).is_file()]
        if missing and hub_offline():
            raise ModelNotFoundError(f"model {str(hid)!r}: offline (HF_HUB_OFFLINE is set) and the cached snapshot "
                                     f"{folder} lacks {', '.join(missing)}")
        if missing:
            have = _repo_files(hid, folder)
            other = [f for f in have if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
            hint = (f"; it holds {', '.join(other[:6])}: surojax reads safetensors (or name a GGUF file with "
                    f"{hid.repo}:QUANT)") if other else ""
            raise ModelNotFoundError(f"model {str(hid)!r}: the repo has no {', '.join(missing)}{hint}")
        return folder

    return _memo(("weights", hid, commit), fetch)


def _gguf_tag(path: str) -> str:
    """What a GGUF file's quantisation tag is compared with: the file name without .gguf and split suffix."""
    return _SPLIT_PART.sub("", Path(path).name[: -len(".gguf")]).lower()


def gguf_files(name: str) -> list[str]:
    """The repo files `org/name:QUANT` selects (module docstring), listed without fetching them: those whose name
    ends in -QUANT / .QUANT / _QUANT (case-insensitive; the parts of a split file together). A miss lists the
    repo's GGUF files."""
    hid = parse_hub_id(name)
    if hid is None or hid.quant is None:
        raise ModelNotFoundError(f"model {name!r}: not a Hub GGUF id like org/name:QUANT")
    return _gguf_choice(hid)[1]


def _gguf_choice(hid: HubId) -> tuple[str, list[str]]:
    """(commit, the chosen .gguf files) of a GGUF id; the revision resolves (and the tree listing is cached)
    without fetching any file."""
    listing = _memo(("gguf listing", hid), lambda: _snapshot(hid, hid.revision, []))
    files = [f for f in _repo_files(hid, listing) if f.lower().endswith(".gguf")]
    quant = hid.quant.lower()
    chosen = sorted(f for f in files if not Path(f).name.lower().startswith("mmproj")
                    and re.search(rf"(^|[-._]){re.escape(quant)}$", _gguf_tag(f)))
    if not chosen or len({_gguf_tag(f) for f in chosen}) > 1:
        what = "no" if not chosen else "more than one"
        raise ModelNotFoundError(f"model {str(hid)!r}: {what} GGUF file matches {hid.quant!r} in the repo "
                                 f"(GGUF files: {', '.join(files) or 'none'})")
    return listing.name, chosen


def _fetch_gguf(hid: HubId) -> Path:
    """The (first) .gguf file of a GGUF id, its split parts fetched with it."""
    commit, chosen = _gguf_choice(hid)

    def fetch() -> Path:
        log.info("%s: fetching %s into %s", hid, ", ".join(chosen), hf_hub_cache())
        return _snapshot(hid, commit, [glob.escape(f) for f in chosen]) / chosen[0]

    return _memo(("gguf", hid, commit), fetch)


# -------------------------------------------------------------------------------------------------- datasets

def _datasets_offline() -> bool:
    return hub_offline() or _env_true("HF_DATASETS_OFFLINE")


def _dataset_call(name: str, call: Callable[[Any, HubId], Any]) -> Any:
    """Run `call(datasets module, hub id)`; the library's errors become a DatasetNotFoundError naming the id."""
    import datasets  # a Hub dataset was named: only then is the library (and pyarrow) imported
    from datasets.exceptions import DatasetNotFoundError as MissingDataset, DatasetsError

    hid = parse_hub_id(name, "dataset")
    if hid is None:
        raise DatasetNotFoundError(f"dataset {name!r}: {missing_name(name, 'dataset')}")
    offline = _datasets_offline()
    quiet = logging.getLogger("datasets")  # offline, it warns twice per call that it reads the cache: say it once
    level = quiet.level
    if offline:
        log.info("dataset %s: offline, read from the datasets cache %s", name, datasets.config.HF_DATASETS_CACHE)
        quiet.setLevel(logging.ERROR)
    try:
        return call(datasets, hid)
    except (DatasetsError, ValueError, FileNotFoundError, ConnectionError, HfHubHTTPError,
            httpx.TransportError) as e:
        reason = str(e).strip() or type(e).__name__
        if isinstance(e, MissingDataset) and "doesn't exist on the Hub" in reason:
            reason = f"no such local path, and {reason}"
        if offline and isinstance(e, (ConnectionError, FileNotFoundError)):
            reason = (f"offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set) and it is not in the datasets cache "
                      f"{datasets.config.HF_DATASETS_CACHE}: {reason}")
        raise DatasetNotFoundError(f"dataset {name!r}: {reason}") from None
    finally:
        quiet.setLevel(level)


def _base_split(split: str) -> str:
    return re.split(r"[\[+]", split, maxsplit=1)[0].strip()


def check_dataset(name: str, *, subset: str | None = None, split: str = "train",
                  data_files: str | list | dict | None = None) -> None:
    """Fail fast unless the Hub dataset `name` has `subset` and `split`: its metadata and file list are read
    (datasets.load_dataset_builder), no data is downloaded. Raises DatasetNotFoundError naming the id and why."""
    def check(datasets, hid: HubId) -> None:
        try:
            builder = datasets.load_dataset_builder(hid.repo, name=subset, data_files=data_files,
                                                    revision=hid.revision)
        except ValueError as e:
            if subset is not None and repr(subset) in str(e):  # BuilderConfig 'x' not found. Available: [...]
                raise ValueError(f"no subset {subset!r} ({e}); set `subset:`") from None
            raise
        splits = list(builder.info.splits or {}) or list(builder.config.data_files or {})
        if splits and _base_split(split) not in splits:
            raise ValueError(f"no split {_base_split(split)!r} (splits: {', '.join(splits)}); set `split:`")

    _dataset_call(name, check)


def load_dataset(name: str, *, subset: str | None = None, split: str = "train",
                 data_files: str | list | dict | None = None):
    """The `datasets.Dataset` of one split of the Hub dataset `name` (downloaded and prepared in the datasets
    cache, or read from it offline). Raises DatasetNotFoundError naming the id and why."""
    return _dataset_call(name, lambda datasets, hid: datasets.load_dataset(
        hid.repo, name=subset, split=split, data_files=data_files, revision=hid.revision))
