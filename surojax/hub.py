"""Resolve a model / dataset name to a local directory, without the network.

surojax never downloads. `resolve_local("path/to/dir")` returns the directory; `resolve_local("org/name")`
looks the repo id up in the local Hugging Face cache only, in the layout huggingface_hub writes:

    <cache>/models--org--name/refs/main             text file holding a commit hash
    <cache>/models--org--name/snapshots/<commit>/   the files of that revision (symlinks into blobs/)

<cache> is the first set of $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub,
~/.cache/huggingface/hub (huggingface_hub's own order). A miss is a ModelNotFoundError that says what to pass.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_KIND_PREFIX = {"model": "models", "dataset": "datasets", "space": "spaces"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelNotFoundError(FileNotFoundError):
    """A name that is neither an existing local path nor a repo id present in the local Hugging Face cache."""

    is_user_error = True


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory the environment points at (it need not exist)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.endswith("/") or name.count("/") > 1


def _miss(name: str, kind: str, why: str) -> ModelNotFoundError:
    flag = "--repo-type dataset " if kind == "dataset" else ""
    return ModelNotFoundError(
        f"{kind} {name!r} was not found locally (no such path; read as a Hugging Face repo id: {why}). "
        f"surojax does not download: fetch it on a machine with "
        f"network access, e.g. `huggingface-cli download {flag}{name} --local-dir DIR`, and pass DIR instead "
        f"(or set HF_HUB_CACHE to a cache that holds it).")


def resolve_local(name_or_path: str | os.PathLike, kind: str = "model", revision: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> Path:
    """A local directory for `name_or_path`: the path itself if it exists, else the cached snapshot of a repo id.

    `revision` is a branch / tag name with a refs/ entry, or a full commit hash (default "main"; a cache holding
    a single snapshot and no refs is accepted). `name@revision` is read as well.
    """
    if kind not in _KIND_PREFIX:
        raise ValueError(f"kind must be one of {sorted(_KIND_PREFIX)}, got {kind!r}")
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{path} is a file; pass the directory that holds the {kind}'s files")
        return path
    if "@" in name and revision is None:
        name, revision = name.rsplit("@", 1)
    if _looks_like_path(name) or not _REPO_ID.match(name):
        raise ModelNotFoundError(f"{kind} path {name_or_path!s} does not exist (and is not a Hugging Face repo id "
                                 "like 'org/name')")

    cache = Path(cache_dir).expanduser() if cache_dir is not None else hf_hub_cache()
    repo_dir = cache / f"{_KIND_PREFIX[kind]}--{name.replace('/', '--')}"
    if not repo_dir.is_dir():
        raise _miss(name, kind, f"no {repo_dir.name} in the Hugging Face cache {cache}")
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / (revision or "main")
    if revision is not None and _COMMIT.match(revision):
        commit = revision
    elif ref.is_file():
        commit = ref.read_text().strip()
    elif revision is None and snapshots.is_dir() and len(found := [p for p in snapshots.iterdir() if p.is_dir()]) == 1:
        commit = found[0].name
    else:
        have = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
        raise _miss(name, kind, f"revision {revision or 'main'!r} has no refs entry in {repo_dir}; "
                                f"snapshots present: {have or 'none'}")
    snapshot = snapshots / commit
    if not snapshot.is_dir():
        raise _miss(name, kind, f"snapshot {commit} of revision {revision or 'main'!r} is missing from {snapshots}")
    return snapshot
