"""`chunk_gated_delta_rule(...)`: the gated delta rule over whole rows (training, prefill), the implementation
chosen; `recurrent_gated_delta_step(...)`: one token (decode). Semantics and operands: reference.py.

impl: "reference" (the token-by-token scan), or "auto" (today the reference: the chunked form and its Pallas
kernels come in this package's next files, each tested against the reference).
"""
from __future__ import annotations

from pallas_kernels.gated_delta.reference import gated_delta_rule_reference, recurrent_gated_delta_step

IMPLS = ("auto", "reference")


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float, segment_ids=None, initial_state=None,
                           output_final_state: bool = False, impl: str = "auto"):
    """(o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] fp32 or None): reference.py's operands."""
    if impl not in IMPLS:
        raise ValueError(f"chunk_gated_delta_rule: impl {impl!r} is unknown ({', '.join(IMPLS)})")
    return gated_delta_rule_reference(q, k, v, g, beta, scale=scale, segment_ids=segment_ids,
                                      initial_state=initial_state, output_final_state=output_final_state)


__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_step"]
