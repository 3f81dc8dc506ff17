"""Atomic file writes with the mode any new file of the user's gets.

    with atomic_path(path) as tmp:     # tmp: a fresh, hidden name in path's folder
        write(tmp)                     # any writer: safetensors, gguf, json, numpy ...
    # here `path` holds the whole file (renamed over any old one); on an exception tmp is removed, path untouched

`AtomicFile(path)` is the same as an object (`.tmp`, `.commit()`, `.discard()`) for code that cannot nest its
writing in a `with` block.

The mode: `tmp` is created first with open(O_CREAT, 0o666), so the kernel applies the umask (and a default ACL)
exactly as for any file the user writes (0644 under umask 022). Writers that replace the file they are given by
their own temporary file (safetensors' save_file makes it 0600 with mkstemp) would leave that mode on the result,
so the created mode is set again on `tmp` just before the rename.
"""
from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path


class AtomicFile:
    """A fresh, hidden temporary file next to `path` (created now, with the usual new-file mode): write `tmp`,
    then `commit()` (it becomes `path`, with that mode) or `discard()` (removed; `path` untouched)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            self.mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def commit(self) -> None:
        os.chmod(self.tmp, self.mode)
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to `path` to write; renamed to `path` (with the usual new-file mode) on success,
    removed on an exception."""
    f = AtomicFile(path)
    try:
        yield f.tmp
        f.commit()
    except BaseException:
        f.discard()
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`text` (UTF-8) into `path`, atomically, with the usual new-file mode."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
