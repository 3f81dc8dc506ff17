"""The attention backend as a typed value: which kernel the layers' self-attention runs, parsed once.

    AttentionBackend(kind, max_segments, check)      frozen; str() gives the config spelling back
    parse_attention_backend("cudnn:8:nocheck", key=)  the one parser of the config / CLI strings:
        auto | xla | cudnn | cudnn:M | cudnn:M:nocheck   (M: the most segments per packed row cuDNN is given, >= 2)

The YAML key `attention`, `surojax bench train --attention` and `surojax serve --attention` keep their strings;
each is parsed here once (a bad one names its key and the accepted forms) and everything below the config
(run_spec's ModelSpec, packed_backend, Decoder / Attention, the bench, serving) carries the value. `auto` stays
`auto` until the layers are built (`resolved()`: cuDNN on a GPU, xla elsewhere), so a spec made on one machine
means the same on another. The meaning of M and of the per-layer check: models/layers/attention.py. This module
imports nothing heavy (no jax): the CLI's argument parsing and serving's config read it.
"""
from __future__ import annotations

import dataclasses
import enum

DEFAULT_MAX_SEGMENTS = 16
FORMS = "auto, xla, cudnn, cudnn:M or cudnn:M:nocheck (M: an integer >= 2)"


class AttentionKind(enum.StrEnum):
    AUTO = "auto"    # cudnn on a GPU, xla elsewhere (decided when the layers are built)
    XLA = "xla"      # einsum + masked softmax, any device: the reference
    CUDNN = "cudnn"  # cuDNN's fused flash attention (GPU; packed rows by its ragged layout)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """kind; max_segments: cuDNN's static bound M of segments per packed row (None: DEFAULT_MAX_SEGMENTS); check:
    the per-layer switch that falls back to xla for batches cuDNN cannot express (False: `nocheck`, only for
    callers that guarantee the packing). max_segments and check belong to cudnn alone."""

    kind: AttentionKind = AttentionKind.AUTO
    max_segments: int | None = None
    check: bool = True

    def __post_init__(self):
        if self.kind is not AttentionKind.CUDNN and (self.max_segments is not None or not self.check):
            raise ValueError(f"attention backend {self.kind.value}: max_segments and check belong to cudnn only")
        if self.max_segments is not None and self.max_segments < 2:
            raise ValueError(f"attention backend cudnn: max_segments must be >= 2, got {self.max_segments}")
        if not self.check and self.max_segments is None:
            raise ValueError("attention backend cudnn: nocheck needs its segment bound (cudnn:M:nocheck)")

    @property
    def segments(self) -> int:
        """M: the segment bound cuDNN's packed layout is built with."""
        return DEFAULT_MAX_SEGMENTS if self.max_segments is None else self.max_segments

    def resolved(self, platform: str) -> AttentionBackend:
        """auto -> cudnn on a GPU (`platform`: jax.default_backend()), xla elsewhere; anything else unchanged."""
        if self.kind is not AttentionKind.AUTO:
            return self
        return AttentionBackend(AttentionKind.CUDNN if platform == "gpu" else AttentionKind.XLA)

    def __str__(self) -> str:
        if self.max_segments is None:
            return self.kind.value
        return f"{self.kind.value}:{self.max_segments}" + ("" if self.check else ":nocheck")


AUTO = AttentionBackend()
XLA = AttentionBackend(AttentionKind.XLA)


def parse_attention_backend(text: str, *, key: str = "attention") -> AttentionBackend:
    """The config / CLI spelling -> AttentionBackend; ValueError naming `key`, the value and the accepted forms."""
    parts = str(text).strip().split(":")
    try:
        kind = AttentionKind(parts[0])
    except ValueError:
        kind = None
    bad = (kind is None or len(parts) > 3 or (len(parts) > 1 and kind is not AttentionKind.CUDNN)
           or (len(parts) == 3 and parts[2] != "nocheck"))
    if not bad and len(parts) >= 2:
        bad = not parts[1].isdigit() or int(parts[1]) < 2
    if bad:
        raise ValueError(f"{key}: {text!r} is not an attention backend; expected {FORMS}")
    m = int(parts[1]) if len(parts) >= 2 else None
    return AttentionBackend(kind, m, len(parts) < 3)


def as_attention_backend(value: AttentionBackend | str, *, key: str = "attention") -> AttentionBackend:
    """A public entry point's argument (Decoder, load_model: a value, or its spelling, parsed once here)."""
    return value if isinstance(value, AttentionBackend) else parse_attention_backend(value, key=key)


__all__ = ["AUTO", "DEFAULT_MAX_SEGMENTS", "FORMS", "XLA", "AttentionBackend", "AttentionKind",
           "as_attention_backend", "parse_attention_backend"]
