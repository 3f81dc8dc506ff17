"""Where `POST /v1/load_lora_adapter` may read from: one directory the operator names (`--lora-root`).

Security model: a client that holds the API key may ask the server to read a LoRA adapter at run time (off by
default: `--allow-runtime-lora`). Without a confinement, "lora_path" would let it make the server open any file
the server's user can read. `LoraRoot.resolve` admits a path only when

* it names a folder inside the root (a relative path is taken relative to the root, an absolute one must lie
  inside it) once every symlink and ``..`` is resolved (`os.path.realpath`), and
* that folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as regular files which themselves
  resolve inside the root (a symlinked config pointing at /etc/passwd is refused).

Every refusal is a `LoraPathRefused` whose message names the path as the client gave it and never anything read
from a file; the adapter loader's own errors (which quote file contents: JSON parse positions, config values)
are for the server log, not the response (`api_server`). The check runs before any byte of the adapter is read;
the check and the read are two steps, so the root must not be writable by the clients it confines.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from surojax.peft.peft_io import CONFIG_FILE, WEIGHTS_FILE

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


class LoraPathRefused(ValueError):
    """A runtime adapter path the server will not read (the HTTP layer answers 400 with this message)."""


@dataclass(frozen=True)
class LoraRoot:
    """root: an existing directory, stored resolved (absolute, no symlinks)."""

    root: Path

    @classmethod
    def at(cls, directory: str | os.PathLike) -> "LoraRoot":
        resolved = Path(os.path.realpath(directory))
        if not resolved.is_dir():
            raise ValueError(f"--lora-root {os.fspath(directory)!r} is not a directory")
        return cls(resolved)

    def _inside(self, path: Path) -> bool:
        return path == self.root or path.is_relative_to(self.root)

    def resolve(self, given: str) -> Path:
        """The client's "lora_path" -> the adapter folder's resolved path, or `LoraPathRefused`."""
        if not given or "\x00" in given:
            raise LoraPathRefused("lora_path is empty or not a valid path")
        folder = Path(os.path.realpath(self.root / given))  # an absolute `given` replaces the root in the join
        if not self._inside(folder):
            raise LoraPathRefused(f"lora_path {given!r} is outside the --lora-root directory; runtime adapters are "
                                  "read only from there (a relative path is taken relative to it)")
        if not folder.is_dir():
            raise LoraPathRefused(f"lora_path {given!r} is not an adapter folder under --lora-root")
        for name in ADAPTER_FILES:
            file = folder / name
            real = Path(os.path.realpath(file))
            if not self._inside(real):
                raise LoraPathRefused(f"lora_path {given!r}: {name} resolves outside the --lora-root directory")
            if not real.is_file():
                raise LoraPathRefused(f"lora_path {given!r} is not a PEFT LoRA adapter folder (it needs "
                                      f"{' and '.join(ADAPTER_FILES)})")
        return folder


__all__ = ["ADAPTER_FILES", "LoraPathRefused", "LoraRoot"]
