"""Group GPU kernel names from a jax.profiler trace into coarse categories (shared by the profiling scripts)."""
from __future__ import annotations


def category(name: str, categories: list[tuple[str, tuple[str, ...]]]) -> str:
    """The first category one of whose substrings occurs in the kernel name (lower case), else "other"."""
    low = name.lower()
    for cat, keys in categories:
        if any(k in low for k in keys):
            return cat
    return "other"
